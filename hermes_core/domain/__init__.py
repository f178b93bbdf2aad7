"""What the library talks about, with no I/O: the models, the plugin specs, session keys,
errors, text normalisation, the gateway's commands and UTC times."""
