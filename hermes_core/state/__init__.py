"""Files of the state directory: secure, atomic and durable file primitives (:mod:`.files`) and
the running gateway's instance lock, clean-shutdown marker and instance id (:mod:`.instance`)."""
