"""The operator commands of ``hermes-sessions``: each module registers its subcommands on the
parser built by :mod:`hermes_core.cli` and implements them over a state directory or a store
URL. Shared helpers (which store, how to open it, output, progress) live in ``common``."""
