"""faust-streaming processors: admission, response aggregation and the agentic group queue. Thin:
decode -> rollstream.filtering -> write table state back by assignment -> emit events. The work of
the aggregator and the group queue is done by faust-free processors (``aggregation``,
``group_queue_processor``) that tests, benchmarks and tools call directly."""
