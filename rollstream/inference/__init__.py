"""Everything that turns token ids into samples: the engine protocol and its types (engine),
the engines in this process (transformers_engine, vllm_engine) and by name (backends), the
client of inference servers with its routing, retries and in-place weight loading
(server_client), the local vLLM server it can start (local_server) and the worker extension
vLLM loads to refresh weights in place (vllm_extension). The Kafka workers that call them live
in rollstream.workers."""
