"""faust-streaming stages: admission, response aggregation and the agentic group queue.

Each stage is a triplet: its decisions in ``rollstream.filtering`` (pure state machines), a
faust-free processor here (``<stage>_processor``: a dict-like table in, events out; tests,
benchmarks and tools call it directly) and a short faust shell (``<stage>``). Everything that
touches faust itself lives in ``common``."""
