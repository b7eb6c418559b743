"""The ONNX recipe of docs/runtimes.md: a stock export loaded with experts_implementation="batched_mm",
exported by torch.onnx.export (its TorchScript exporter, the fast one), run in ONNX Runtime within 1e-4 of
transformers.

transformers' default grouped experts use aten::histc, which the ONNX exporter has no translation for; the
"batched_mm" experts are plain batched matmuls. The exporter's graph also computes the logits of left-padded
positions differently (they are masked out and never read); only real tokens are compared.
"""

from __future__ import annotations

import pytest
import torch
import transformers as T

onnxruntime = pytest.importorskip("onnxruntime", reason="the ONNX recipe is checked in ONNX Runtime (pip install "
                                                       "onnx onnxruntime onnxscript)")


class Logits(torch.nn.Module):
    """The model as ONNX sees it: token ids and attention mask in, logits out (no KV cache)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def test_stock_export_runs_in_onnx_runtime(tmp_path):
    from test_export_tokenizer import exported, toy_tokenizer

    exported("llama", 2, "auto", tmp_path / "hf", toy_tokenizer())
    model = T.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", experts_implementation="batched_mm").eval()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    dims = {0: "batch", 1: "sequence"}
    # the TorchScript exporter: 1 s here against 10 s for the dynamo one (same accuracy on real tokens, measured
    # in docs/runtimes.md)
    torch.onnx.export(Logits(model), (ids, torch.ones_like(ids)), str(tmp_path / "model.onnx"),
                      input_names=["input_ids", "attention_mask"], output_names=["logits"],
                      dynamic_axes={"input_ids": dims, "attention_mask": dims, "logits": dims}, dynamo=False)
    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"))
    for shape in ((2, 8), (3, 11)):            # other batch and sequence sizes than the traced ones
        ids = torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        mask[0, :3] = 0                        # left padding, as a batched generate pads
        onnx = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
        with torch.no_grad():
            expected = Logits(model)(ids, mask).numpy()
        real = mask.bool().numpy()
        assert abs(onnx[real] - expected[real]).max() < 1e-4
