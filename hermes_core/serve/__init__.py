"""Serving a gateway to real platforms: the HTTP app (:mod:`~hermes_core.serve.app`), its
metrics (:mod:`~hermes_core.serve.metrics`) and ``hermes-sessions serve``
(:mod:`~hermes_core.serve.runner`). Needs the ``serve`` extra; ``import hermes_core`` never
imports this package."""
