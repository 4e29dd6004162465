"""Methods rollstream adds to a vLLM server's workers (``--worker-extension-cls``), called
through its ``/collective_rpc`` endpoint. This module runs inside the vLLM environment: it
imports nothing of rollstream's and nothing vLLM does not carry.

vLLM's CPU build multiplies by the output embedding through a kernel it prepares once from the
weight (a oneDNN handle). An in-place ``reload_weights`` refreshes the layers it loads, but a
tied output embedding loads nothing of its own (its weight is the input embedding's), so its
kernel keeps multiplying by the old weights: after an update the server's logits mix new hidden
states with the old output embedding (measured on SmolLM2-135M: 1.1 nats off the new weights,
0.05 after ``refresh_output_embedding``).
"""

from __future__ import annotations


class WeightSyncExtension:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``."""

    def refresh_output_embedding(self) -> bool:
        """Rebuild the output embedding's kernel from its current weight; returns whether the
        model has an output embedding to refresh."""
        model = self.model_runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        method = getattr(lm_head, "quant_method", None)
        if method is None:
            return False
        method.process_weights_after_loading(lm_head)
        return True


WORKER_EXTENSION = f"{__name__}.{WeightSyncExtension.__qualname__}"
"""What vLLM's ``--worker-extension-cls`` (or ``LLM(worker_extension_cls=...)``) takes."""
