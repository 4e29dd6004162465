"""The fixed prompt whose answer names an inference engine's weights (the tests hold the engine's
logprobs of its answer against ``rollstream.trainer.logprobs.sequence_log_probs``)."""

PROBE = [1, 504, 3458, 314, 3997, 28]
