"""The ``hermes-sessions`` command line: :mod:`.main` builds the parser, and each module
registers its subcommands on it and implements them over a state directory or a store URL.
Shared helpers (which store, how to open it, output, progress) live in :mod:`.common`."""
