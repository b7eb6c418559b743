"""The same guarantees on real weights: the embedded SmolLM2-135M (Llama) and all-MiniLM-L6-v2 (BERT)."""

from __future__ import annotations

import json

import pytest
import torch

import upcycle
from upcycle.checkpoint.loading import load_dense
from upcycle.config import CheckConfig, ConvertConfig
from upcycle.config_reader import build
from upcycle.conversion.pipeline import convert, upcycle_model
from upcycle.core.moe import moe_layers
from upcycle.probe import make_probe, probe_output

pytestmark = pytest.mark.slow
# Mean token KL(dense || upcycled) that float32 rounding can cause: logit differences of ~1e-4 give a KL of
# order (1e-4)^2 = 1e-8 at most per token and far less on average (measured 5.9e-12 for granular); a real
# change is far above (spri with rho=1e-3 on two blocks: 3e-7).
KL_ROUNDING = 1e-8


def test_smollm2_copy_preserves_and_round_trips(tmp_path):
    cfg = build(ConvertConfig, {"model": "default", "method": "copy", "moe": {"num_experts": 8, "top_k": 2},
                                "placement": {"every": 2}})
    out = tmp_path / "smollm2-moe"
    result = convert(cfg, out, progress=False)
    r = json.loads((out / "upcycle_report.json").read_text())
    assert r["model_type"] == "llama" and r["num_moe_layers"] == 15 and r["moe_layers"][0] == "text.1"
    assert r["preservation"]["probe_source"] == "held-out Wikipedia (embedded)"
    assert r["preservation"]["compared_rows"] == 512
    # float32 rounding through 15 MoE blocks, which differs between CPUs' kernels: measured 1.05e-4 here and on
    # another machine (max |logit| 40, so relative 2.6e-6). The product's own check allows 16x the rounding
    # noise of the dense model summed in another order (2.4e-4 here); the test's independent bound is relative,
    # 1e-4 of the logits' scale (~40x the measured value), still ~1000x below a real break (drop: > 0.1).
    p = r["preservation"]
    assert p["passed"] and r["max_abs_logit_diff"] <= p["allowed_max_abs_logit_diff"]
    assert p["relative_logit_diff"] <= 1e-4
    assert r["kl_to_dense"] < KL_ROUNDING
    # parameters: 7 extra copies of a 3 x 576 x 1536 SwiGLU FFN per MoE layer, plus an 8 x 576 router
    ffn, router = 3 * 576 * 1536, 8 * 576
    before, after = r["parameters"]["before"], r["parameters"]["after"]
    assert before["total"] == 134_515_008
    assert after["total"] == before["total"] + 15 * (7 * ffn + router)
    assert after["active_per_token"] == before["total"] + 15 * (ffn + router)

    loaded = upcycle.load(out)
    probe = make_probe(loaded, result.tokenizer, ["The quick brown fox jumps over the lazy dog. " * 40],
                       CheckConfig(sequences=2, tokens=64), seed=0)
    assert torch.equal(probe_output(loaded, probe).values_NC, probe_output(result.model, probe).values_NC)
    text = result.tokenizer.decode(loaded.generate(**result.tokenizer("The capital of France is", return_tensors="pt"),
                                                   max_new_tokens=5, do_sample=False)[0])
    assert text.startswith("The capital of France is")


@pytest.mark.parametrize("method", ["noise", "drop"])
def test_smollm2_perturbing_methods_are_deterministic(method):
    model, tokenizer = load_dense("default")
    cfg = build(ConvertConfig, {"method": method, "moe": {"num_experts": 4, "top_k": 2},
                                "placement": {"layers": [3, 20]}, "check": {"sequences": 1, "tokens": 32}})
    states = []
    for _ in range(2):
        m = model if not states else load_dense("default")[0]
        report = upcycle_model(m, cfg, progress=False).to_dict()
        assert report["kl_to_dense"] > 0
        states.append({k: v.clone() for name, layer in moe_layers(m).items() for k, v in layer.state_dict().items()})
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_minilm_bert_copy_preserves_and_round_trips(tmp_path):
    cfg = build(ConvertConfig, {"model": "minilm", "method": "copy", "moe": {"num_experts": 4, "top_k": 2}})
    out = tmp_path / "minilm-moe"
    result = convert(cfg, out, progress=False)
    r = result.report.to_dict()
    assert r["model_type"] == "bert" and r["num_moe_layers"] == 6
    assert r["preservation"]["compared_output"] == "last_hidden_state" and r["kl_to_dense"] is None
    # hidden states of max |value| 6.1 through 6 MoE blocks: measured 3.6e-6 (relative 6e-7); bound 1e-4
    # relative, ~170x above it and ~100x below drop's drift (> 1e-3 absolute, the next test)
    assert r["preservation"]["passed"] and r["preservation"]["relative_logit_diff"] <= 1e-4
    loaded = upcycle.load(out)
    probe = make_probe(loaded, result.tokenizer, ["Sparse experts add capacity at the same compute. " * 30],
                       CheckConfig(sequences=2, tokens=64), seed=0)
    assert torch.equal(probe_output(loaded, probe).values_NC, probe_output(result.model, probe).values_NC)


def test_minilm_drop_reports_drift_on_a_user_text_file(tmp_path):
    probe = tmp_path / "probe.jsonl"
    probe.write_text("\n".join(json.dumps({"text": f"Sentence number {i} about mixtures of experts."})
                               for i in range(100)))
    cfg = build(ConvertConfig, {"model": "minilm", "method": "drop", "method_args": {"ratio": 0.25},
                                "moe": {"num_experts": 4, "top_k": 1}, "placement": {"every": 2},
                                "check": {"text": str(probe)}})
    r = convert(cfg, tmp_path / "o", progress=False).report.to_dict()
    assert r["num_moe_layers"] == 3 and r["max_abs_logit_diff"] > 1e-3
    assert r["preservation"]["probe_source"] == f"text file {probe}"


def test_minilm_same_seed_same_bytes(tmp_path):
    outs = []
    for i in range(2):
        cfg = build(ConvertConfig, {"model": "minilm", "method": "noise", "seed": 3,
                                    "moe": {"num_experts": 4, "top_k": 2}, "placement": {"layers": [2]}})
        convert(cfg, tmp_path / str(i), progress=False)
        outs.append((tmp_path / str(i) / "model.safetensors").read_bytes())
    assert outs[0] == outs[1]


def test_smollm2_bad_input(tmp_path):
    model, _ = load_dense("default")
    for data, message in (({"placement": {"layers": [30]}}, r"out of range.*30 blocks"),
                          ({"placement": {"every": 31}}, "matched zero layers"),
                          ({"moe": {"num_experts": 4, "top_k": 8}}, "top_k must be between")):
        with pytest.raises(upcycle.UpcycleError, match=message):
            upcycle_model(model, build(ConvertConfig, data), progress=False)
    assert not moe_layers(model)
    (tmp_path / "exists").mkdir()
    (tmp_path / "exists" / "notes.txt").write_text("mine")       # (an empty folder is taken: nothing to lose)
    with pytest.raises(upcycle.UpcycleError, match="already exists"):
        convert(build(ConvertConfig, {}), tmp_path / "exists", progress=False)


@pytest.mark.parametrize("method", ["copy", "drop"])
def test_smollm2_exports_to_qwen2_moe(tmp_path, method):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = build(ConvertConfig, {"model": "default", "method": method, "moe": {"num_experts": 8, "top_k": 2},
                                "placement": {"every": 2}, "export": "hf"})
    out = tmp_path / "smollm2-qwen2moe"
    result = convert(cfg, out, progress=False)
    export = result.report.to_dict()["export"]
    # the stock class runs the same kernels in the same order as our layer (moe.py sorts slots as transformers
    # does): measured 0.0; 1e-5 is check.export_tolerance, the product's own bound
    assert export["class"] == "Qwen2MoeForCausalLM" and export["max_abs_logit_diff_vs_upcycle"] <= 1e-5
    assert export["dense_layers"] == list(range(0, 30, 2))
    stock = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    batch = tokenizer(["Mixture-of-experts models route each token to a few experts."], return_tensors="pt")
    with torch.no_grad():
        diff = (stock(**batch).logits - result.model(**batch).logits).abs().max().item()
    assert diff <= 1e-5
    text = tokenizer.decode(stock.generate(**batch, max_new_tokens=5, do_sample=False)[0])
    assert text.startswith("Mixture-of-experts models route")


def smollm2_layers(method: str, moe: dict | None = None, **method_args) -> dict:
    model, tokenizer = load_dense("default")
    cfg = build(ConvertConfig, {"method": method, "method_args": method_args,
                                "moe": {"num_experts": 8, "top_k": 2, **(moe or {})},
                                "placement": {"layers": [3, 20]}})
    from upcycle.conversion.model_data import probe_texts
    return upcycle_model(model, cfg, tokenizer=tokenizer, texts=probe_texts(cfg.check.text), progress=False).to_dict()


def test_smollm2_spri_drift_is_of_order_rho_and_exact_at_zero():
    # measured: rho=1e-3 drifts 0.065 (KL 3e-7), rho=1e-2 0.66 (KL 3e-5): linear in rho, so the bounds hold
    # 15x (drift), 300x (KL) and 3.4x (growth) away from the values on any CPU (rounding is 1e-4)
    small = smollm2_layers("spri", rho=1e-3)
    assert small["max_abs_logit_diff"] < 1.0 and small["kl_to_dense"] < 1e-4
    larger = smollm2_layers("spri", rho=1e-2)
    assert larger["max_abs_logit_diff"] > 3 * small["max_abs_logit_diff"]     # drift grows with rho
    exact = smollm2_layers("spri", rho=0.0)
    assert exact["preservation"]["promised"] and exact["preservation"]["passed"]
    assert exact["kl_to_dense"] < KL_ROUNDING


@pytest.mark.parametrize("normalize", [True, False])
def test_smollm2_granular_reproduces_the_dense_model(normalize):
    r = smollm2_layers("granular", moe={"top_k": 4, "normalize_topk": normalize})
    assert r["preservation"]["promised"] and r["preservation"]["passed"] and r["kl_to_dense"] < KL_ROUNDING


def test_smollm2_cluster_from_a_user_file_through_the_cli(tmp_path, capsys):
    from upcycle.cli import main
    from upcycle.data.text import wikipedia_split

    calib = tmp_path / "calib.jsonl"
    calib.write_text("\n".join(json.dumps({"text": t}) for t in wikipedia_split()[0][:20]))
    out = tmp_path / "cluster"
    code = main(["convert", "default", str(out), "--method", "cluster", "--num-experts", "4", "--layers", "3,20",
                 "--calibration", str(calib), "--calibration-tokens", "4096", "--quiet"])
    assert code == 0, capsys.readouterr().err
    r = json.loads((out / "upcycle_report.json").read_text())
    assert r["calibration"]["source"] == f"text file {calib}" and r["calibration"]["real_tokens"] >= 4096
    for layer in r["layers"]:
        assert layer["calibration_tokens_kept"] == 4096 and sum(layer["cluster_sizes"]) == 4096
        assert layer["router_cluster_agreement"] == 1.0          # without PCA: exactly the clusters
        assert min(min(v) for v in layer["ranks"].values()) >= 288   # half of rank 576
        # a cluster with fewer tokens than the width (576) has a singular X X^T: damped, and said so
        small = [n < 576 for n in layer["cluster_sizes"]]
        assert [lam > 0 for lam in layer["damping"]] == small and layer["damped_clusters"] == sum(small)
        assert len(layer["router_load"]) == 4
    assert 0 < r["kl_to_dense"] < 5
    assert upcycle.load(out) is not None


def test_smollm2_all_moe_mixtral_export_passes_the_calibrated_check(tmp_path, capsys):
    """Every block MoE is float32 rounding through 30 blocks (0.000536, over a fixed 1e-4): the allowance follows
    from the rounding the dense model itself shows on the probe, so the export passes its check."""
    from upcycle.cli import main

    out = tmp_path / "mixtral"
    code = main(["convert", "default", str(out), "--num-experts", "4", "--top-k", "2", "--every", "1",
                 "--export", "hf", "--export-class", "mixtral", "--quiet"])
    assert code == 0, capsys.readouterr().err
    r = json.loads((out / "upcycle_report.json").read_text())
    p = r["preservation"]
    assert r["num_moe_layers"] == 30 and r["export"]["class"] == "MixtralForCausalLM"
    # measured with 8 experts: difference 5.4e-4, rounding noise 4.0e-4 (ratio 1.4), allowed 16x = 6.3e-3
    assert p["passed"] and 0 < p["rounding_noise"] and r["max_abs_logit_diff"] <= p["allowed_max_abs_logit_diff"]
    assert p["allowed_max_abs_logit_diff"] == p["calibrated_tolerance"] > p["ulp_floor"]
    assert r["kl_to_dense"] < KL_ROUNDING


def test_smollm2_all_moe_refuses_a_one_percent_wrong_scale(monkeypatch):
    """The other side on real weights: every expert of block 15 of 30 scaled by 1.01 (a fold off by 1%)."""
    from test_preservation import break_layer

    from upcycle.conversion.model_data import probe_texts
    from upcycle.conversion.pipeline import PreservationError

    model, tokenizer = load_dense("default")
    cfg = build(ConvertConfig, {"method": "copy", "moe": {"num_experts": 8, "top_k": 2}})
    break_layer(monkeypatch, 1.01, rows=(slice(None),), layer=15)
    with pytest.raises(PreservationError) as err:
        upcycle_model(model, cfg, tokenizer=tokenizer, texts=probe_texts(cfg.check.text), progress=False)
    # measured 0.10 against an allowance of 6.3e-3 (16x); the same break in block 0 is 400x, x2 is 1400x+.
    # One row x1.001 is not tested here: in a 30-block float32 model it moves the logits by 0 to 6.6e-3
    # depending on the row, i.e. within the rounding (docs/conversion.md, "What rounding can explain").
    r = err.value.report.to_dict()
    assert r["max_abs_logit_diff"] > 5 * r["preservation"]["allowed_max_abs_logit_diff"]
