"""`cluster` (Cluster-aware Upcycling, docs/methods.md §2.5): exact properties at init, reports, errors."""

from __future__ import annotations

import pytest
import torch
from test_calibration import batches_for

from conftest import make_tiny
from upcycle.config import ConvertConfig
from upcycle.config_reader import build
from upcycle.conversion.pipeline import convert, upcycle_model
from upcycle.core.ffn import FFNWeights
from upcycle.core.moe import MoELayer
from upcycle.errors import UpcycleError
from upcycle.methods import get_method

D, F, E = 16, 40, 4


def dense(gated=True, seed=0) -> FFNWeights:
    g = torch.Generator().manual_seed(seed)
    return FFNWeights(w_up=torch.randn(F, D, generator=g), w_down=torch.randn(D, F, generator=g),
                      w_gate=torch.randn(F, D, generator=g) if gated else None,
                      b_up=None if gated else torch.randn(F, generator=g), activation="silu" if gated else "gelu")


def activations(n=800, seed=0, spread=0.6) -> torch.Tensor:
    """Tokens around E random directions, with an offset so PCA centering matters."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(E, D, generator=g) * 3
    x = centres[torch.arange(n) % E] + spread * torch.randn(n, D, generator=g)
    return x + 0.5


def run(ffn=None, x=None, seed=0, **args):
    method = get_method("cluster")
    return method(ffn or dense(), method.resolve_args(args), num_experts=E, top_k=2,
                  generator=torch.Generator().manual_seed(seed), activations=activations() if x is None else x)


def layer_of(init, top_k=2):
    return MoELayer.from_init(init.experts, init.router_ED, top_k=top_k, router_bias_E=init.router_bias_E)


@pytest.mark.parametrize("gated", [True, False])
def test_router_top1_is_the_cluster_for_every_token_without_pca(gated):
    x = activations()
    init = run(dense(gated), x)
    record = layer_of(init).route(x)
    assert torch.equal(record.topk_ids_TK[:, 0], init.token_clusters)
    assert torch.allclose(init.router_ED.norm(dim=1), torch.ones(E))      # unit centroids
    assert sorted(init.info["cluster_sizes"]) == [200] * 4                 # the four planted groups


@pytest.mark.parametrize("gated", [True, False])
def test_each_expert_is_the_data_aware_truncation_of_its_cluster(gated):
    ffn, x = dense(gated), activations()
    init = run(ffn, x, tau=0.8)
    names = ("w_gate", "w_up") if gated else ("w_up",)
    for i in range(E):
        X_i = x[init.token_clusters == i].double()
        assert init.info["damping"][i] == 0.0
        for name in names:
            W, W_i = getattr(ffn, name).double(), getattr(init.experts, name)[i].double()
            rank = init.info["ranks"][name[2:]][i]
            s = torch.linalg.svdvals(W @ torch.linalg.cholesky(X_i.T @ X_i))
            err = ((X_i @ W.T - X_i @ W_i.T) ** 2).sum()
            discarded = (s[rank:] ** 2).sum()
            assert abs(err - discarded) <= 1e-4 * discarded          # ||W X_i - W~_i X_i||^2 = sum_{j>r} s_j^2
            assert rank >= D // 2                                     # never below half the full rank (16)
            assert init.info["retained_energy"][name[2:]][i] >= 0.8 or rank == D // 2
            assert torch.linalg.matrix_rank(W_i, rtol=1e-5) == rank   # float32 storage: rounding-level tail
        assert torch.equal(init.experts.w_down[i], ffn.w_down)        # second layer copied
        if not gated:
            assert torch.equal(init.experts.b_up[i], ffn.b_up)


def test_pca_maps_centroids_back_with_their_centering_bias():
    x = activations()
    with_bias = run(x=x, pca_factor=4, router_bias=True)
    assert with_bias.info["pca_dim"] == D // 4 and with_bias.router_bias_E is not None
    record = layer_of(with_bias).route(x)
    assert (record.topk_ids_TK[:, 0] == with_bias.token_clusters).double().mean() > 0.999
    without = run(x=x, pca_factor=4)
    assert without.router_bias_E is None and without.info["pca_bias_dropped_max_abs"] > 0
    assert torch.equal(without.router_ED, with_bias.router_ED)   # same clustering, only the bias differs


def test_same_seed_same_bytes_different_seed_different_experts():
    x = activations(spread=2.5)            # overlapping groups: k-means++ seeding decides the partition
    a, b, c = run(x=x, seed=0), run(x=x, seed=0), run(x=x, seed=5)
    for name in ("w_gate", "w_up", "w_down"):
        assert torch.equal(getattr(a.experts, name), getattr(b.experts, name))
    assert torch.equal(a.router_ED, b.router_ED)
    assert not torch.equal(a.experts.w_gate, c.experts.w_gate)


def test_singular_covariance_is_damped_and_reported():
    g = torch.Generator().manual_seed(0)
    low_rank = torch.randn(400, 3, generator=g) @ torch.randn(3, D, generator=g)   # X X^T has rank 3 < D
    init = run(x=low_rank)
    assert init.info["damped_clusters"] == E and all(lam > 0 for lam in init.info["damping"])
    assert torch.isfinite(init.experts.w_gate).all()


def test_clusters_that_would_end_empty_are_repaired():
    # two distinct directions for four experts: k-means must repair empty clusters, and every expert gets tokens
    x = torch.cat([torch.ones(30, D), -torch.ones(30, D)]) + 1e-3 * torch.arange(D)
    init = run(x=x)
    assert all(n > 0 for n in init.info["cluster_sizes"]) and sum(init.info["cluster_sizes"]) == 60
    assert init.info["kmeans"]["repaired_empty_clusters"] > 0


def test_bad_input_is_refused():
    with pytest.raises(UpcycleError, match="3 calibration tokens cannot form 4 clusters"):
        run(x=activations()[:3])
    with pytest.raises(UpcycleError, match="activations must be"):
        run(x=torch.randn(100, D + 1))
    with pytest.raises(UpcycleError, match="zero vector"):
        run(x=torch.cat([activations(), torch.zeros(1, D)]))
    with pytest.raises(UpcycleError, match="NaN"):
        run(x=torch.full((100, D), float("nan")))
    with pytest.raises(UpcycleError, match="tau"):
        run(tau=0.0)
    with pytest.raises(UpcycleError, match="pca_factor"):
        run(pca_factor=0)


def test_conversion_reports_routing_and_cluster_agreement():
    model = make_tiny("qwen2")
    cfg = build(ConvertConfig, {"method": "cluster", "moe": {"num_experts": 4, "top_k": 2},
                                "placement": {"every": 2}, "calibration": {"tokens": 100}})
    report = upcycle_model(model, cfg, calibration=batches_for("qwen2"), progress=False).to_dict()
    assert report["calibration"]["real_tokens"] > 100
    for layer in report["layers"]:
        assert layer["calibration_tokens_kept"] == 100 < layer["calibration_tokens_seen"]
        assert layer["router_cluster_agreement"] == 1.0
        assert sum(layer["cluster_sizes"]) == 100
        assert abs(sum(layer["router_load"]) - 1) < 1e-12 and len(layer["router_load"]) == 4
        assert 0 < layer["routing_entropy"] <= torch.log(torch.tensor(4.0)).item() + 1e-9
        for key in ("ranks", "retained_energy", "damping", "expert_similarity", "diversity"):
            assert key in layer


def test_copy_with_calibration_reports_routing_of_its_random_router():
    model = make_tiny("llama")
    cfg = build(ConvertConfig, {"method": "copy", "moe": {"num_experts": 4, "top_k": 2}})
    report = upcycle_model(model, cfg, calibration=batches_for("llama"), progress=False).to_dict()
    assert report["preservation"]["passed"] and "router_load" in report["layers"][0]
    assert "router_cluster_agreement" not in report["layers"][0]


def test_missing_calibration_is_refused_before_anything_changes(tmp_path):
    model = make_tiny("llama")
    tiny_path = tmp_path / "tiny"
    model.save_pretrained(tiny_path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UpcycleError, match="needs calibration data"):
        upcycle_model(model, build(ConvertConfig, {"method": "cluster"}), progress=False)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    with pytest.raises(UpcycleError, match="pass --calibration FILE"):
        convert(build(ConvertConfig, {"model": str(tiny_path), "method": "cluster"}), tmp_path / "out")
    text = tmp_path / "calib.txt"
    text.write_text("some calibration text\n\nmore text")
    with pytest.raises(UpcycleError, match="no tokenizer"):
        convert(build(ConvertConfig, {"model": str(tiny_path), "method": "cluster",
                                      "calibration": {"data": str(text)}}), tmp_path / "out")
    with pytest.raises(UpcycleError, match="calibration data"):
        convert(build(ConvertConfig, {"model": str(tiny_path), "method": "cluster",
                                      "calibration": {"data": str(tmp_path / "missing.txt")}}), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_clip_cluster_from_a_safetensors_file_of_image_caption_inputs(tmp_path):
    from safetensors.torch import save_file

    model_dir = tmp_path / "clip"
    make_tiny("clip").save_pretrained(model_dir)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (12, 16), generator=g)
    mask = torch.ones_like(ids)
    mask[::3, 10:] = 0
    data = tmp_path / "pairs.safetensors"
    save_file({"pixel_values": torch.randn(12, 3, 16, 16, generator=g), "input_ids": ids, "attention_mask": mask},
              data)
    cfg = build(ConvertConfig, {"model": str(model_dir), "method": "cluster", "placement": {"every": 2},
                                "moe": {"num_experts": 4, "top_k": 1}, "calibration": {"data": str(data),
                                                                                      "batch_size": 5}})
    r = convert(cfg, tmp_path / "out", progress=False).report.to_dict()
    assert r["calibration"] == {"source": f"model inputs {data}", "batches": 3, "real_tokens": int(mask.sum()),
                                "budget_per_layer": 65536}
    towers = {layer["name"].split(".")[0]: layer for layer in r["layers"]}
    assert set(towers) == {"text", "vision"}
    assert towers["text"]["calibration_tokens_kept"] == int(mask.sum())          # padding excluded
    assert towers["vision"]["calibration_tokens_kept"] == 12 * 5                  # 4 patches + CLS per image
    assert all(layer["router_cluster_agreement"] == 1.0 for layer in r["layers"])
    bad = tmp_path / "bad.safetensors"
    save_file({"pixels": torch.zeros(2, 3)}, bad)
    with pytest.raises(UpcycleError, match="must be named"):
        convert(build(ConvertConfig, {"model": str(model_dir), "method": "cluster",
                                      "calibration": {"data": str(bad)}}), tmp_path / "o2", progress=False)
    wrong = tmp_path / "wrong.safetensors"
    # ids outside the vocabulary (with the images a CLIP model needs: a file without them is refused earlier)
    save_file({"input_ids": torch.full((4, 8), 10_000), "pixel_values": torch.zeros(4, 3, 16, 16)}, wrong)
    # refused on the host before any forward (on a GPU the lookup would be a device-side assert)
    with pytest.raises(UpcycleError, match=r"wrong.safetensors \(batch 1\): token id 10000 at position \[0, 0\] is "
                                           r"outside the model's embedding"):
        convert(build(ConvertConfig, {"model": str(model_dir), "method": "cluster", "placement": {"towers": ["text"]},
                                      "calibration": {"data": str(wrong)}}), tmp_path / "o3", progress=False)
    assert not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()
