"""Built-in agents registered in the ``hermes.agents`` entry point group (``echo`` lives in the
core; the ones here need the ``serve`` extra)."""
