"""Plain Kafka workers (kafka-python, rollstream.kafka.event_worker): generation (engines in
``engines``), reward (functions in ``rewards``, answer parsing in ``answers``) and env workers
(``env_worker`` over the Kafka-free ``episodes`` player, ``envs`` and ``env_calls``)."""
