"""A turn and what keeps it: the turn pipeline, the delivery ledger, the lanes' queues,
start-up recovery, resuming interrupted turns and the named crash points."""
