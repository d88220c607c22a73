"""The engine's state machines and the types they exchange with the executors.

``plan`` (frozen types) and ``refusals`` sit below everything; ``cas`` is the one
compare-and-swap; ``admission`` decides whether a claimed job may start (pause,
concurrency, rate); ``job_machine`` and ``effect_machine`` hold every arrow of a
job and of an effect. The executors (``jobs.executors``) carry these out per
database; the delivery (``jobs.delivery``) drives one message through them.
"""
