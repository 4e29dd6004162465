"""faust-streaming stages: admission, response aggregation and the agentic group queue.

Each stage is a triplet: its decisions in ``rollstream.filtering`` (pure state machines), a
faust-free processor here (``<stage>_processor``: its table's values in through a ``store.Store``,
events out; tests, benchmarks and tools call it directly) and a short faust shell (``<stage>``).
The aggregator's and the group queue's processors share one shape (``processor.Processor``) and
one agent (``common.serve_processor``). Time reaches every stage the same way, through
``common.punctuate_every``. Everything that touches faust itself lives in ``common``."""
