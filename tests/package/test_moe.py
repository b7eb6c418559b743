"""The MoE layer against a naive per-token reference, and its routing semantics (docs/methods.md §1)."""

from __future__ import annotations

import math

import pytest
import torch

from upcycle.core.ffn import FFNWeights
from upcycle.core.moe import MoELayer
from upcycle.core.router import capacity_keep
from upcycle.core.routing_context import padding_mask


def random_layer(*, E=4, K=2, D=8, F=12, gated=True, bias=False, shared=0, seed=0, **options) -> MoELayer:
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.3

    experts = FFNWeights(w_up=w(E, F, D), w_down=w(E, D, F), w_gate=w(E, F, D) if gated else None,
                         b_up=w(E, F) if bias else None, b_gate=w(E, F) if bias and gated else None,
                         b_down=w(E, D) if bias else None, activation="silu" if gated else "gelu")
    shared_w = None
    if shared:
        # shared experts have the routed experts' structure (gating, biases): both come from one dense FFN
        shared_w = FFNWeights(w_up=w(shared, F, D), w_down=w(shared, D, F),
                              w_gate=w(shared, F, D) if gated else None, b_up=w(shared, F) if bias else None,
                              b_gate=w(shared, F) if bias and gated else None, b_down=w(shared, D) if bias else None,
                              activation=experts.activation)
    return MoELayer.from_init(experts, w(E, D), top_k=K, shared=shared_w, **options)


def reference(layer: MoELayer, x_TD: torch.Tensor) -> torch.Tensor:
    """Token by token: y = sum_{i in topk} g~_i E_i(x) + sum_s E_s(x)."""
    experts = layer.experts.weights(detach=False)   # still attached to autograd
    out = []
    for x in x_TD:
        probs = torch.softmax(x.float() @ layer.router.weight.float().T, -1)
        ids = (probs + layer.selection_bias).topk(layer.top_k).indices
        weights = probs[ids]
        if layer.normalize_topk:
            weights = weights / weights.sum()
        y = sum(wi * experts.expert(int(i))(x[None])[0] for wi, i in zip(weights, ids, strict=True))
        if layer.shared_experts is not None:
            shared = layer.shared_experts.weights(detach=False)
            y = y + sum(shared.expert(s)(x[None])[0] for s in range(shared.num_experts))
        out.append(y)
    return torch.stack(out)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("bias,shared", [(False, 0), (True, 1), (False, 2)])
def test_forward_matches_per_token_reference(gated, normalize, bias, shared):
    layer = random_layer(gated=gated, bias=bias, shared=shared, normalize_topk=normalize)
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1))
    y = layer(x)
    assert y.shape == x.shape
    torch.testing.assert_close(y.view(-1, 8), reference(layer, x.view(-1, 8)), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("gated,bias", [(True, False), (False, True)])
def test_inference_paths_match_reference(kernel_path, gated, bias):
    """No grad: small batches take one grouped_mm per projection, large ones the per-expert loop."""
    layer = random_layer(E=5, gated=gated, bias=bias, shared=1)
    layer.selection_bias[2] = -10.0       # an expert with no token (an empty group)
    x = torch.randn(23, 8, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(layer(x), reference(layer, x), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("freeze", [False, True])
def test_gradients_match_reference(kernel_path, gated, freeze):
    layer = random_layer(E=6, gated=gated, bias=True, shared=1, seed=5)
    frozen = (f"experts.{layer.experts.in_name}", "experts.b_down") if freeze else ()
    for name in frozen:
        layer.get_parameter(name).requires_grad_(False)
    layer.selection_bias[5] = -10.0           # expert 5 gets no token: its gradient must be exactly zero
    x = torch.randn(17, 8, generator=torch.Generator().manual_seed(2), requires_grad=True)
    layer(x).square().sum().backward()
    ours = {n: p.grad.clone() for n, p in layer.named_parameters() if p.requires_grad}
    ours["x"] = x.grad.clone()
    assert torch.all(layer.experts.w_down.grad[5] == 0) and layer.experts.w_down.grad[:5].abs().sum() > 0
    layer.zero_grad()
    x.grad = None
    reference(layer, x).square().sum().backward()
    for name, p in layer.named_parameters():
        if name in frozen:
            assert p.grad is None
        else:
            torch.testing.assert_close(ours[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)
    torch.testing.assert_close(ours["x"], x.grad, atol=1e-5, rtol=1e-4)


@pytest.fixture(params=["small-batch grouped_mm", "per-expert loop"])
def kernel_path(request, monkeypatch):
    """Run a test through both expert paths (grouped_ffn picks one by batch size), and check afterwards that
    the test did run the path it is named after."""
    import upcycle.core.grouped_ffn as kernel
    grouped = request.param.startswith("small")
    calls = []
    run_grouped = kernel._run_grouped_mm
    monkeypatch.setattr(kernel, "_run_grouped_mm", lambda *a: calls.append(1) or run_grouped(*a))
    with kernel.forced_kernel_path("grouped_mm" if grouped else "loop"):
        yield request.param
    assert bool(calls) == grouped, f"{request.param}: grouped_mm ran {len(calls)} times"


def test_no_per_expert_indexing_of_stacked_weights_in_backward(kernel_path):
    """Indexing w[e] per expert makes backward zero-fill a full [E, F, D] gradient per expert (and unbind
    stacks E copies): each stacked expert tensor must feed exactly one backward node."""
    layer = random_layer(E=8, bias=True)
    y = layer(torch.randn(32, 8))
    expert_params = {id(p): n for n, p in layer.experts.named_parameters()}
    consumers, seen, stack = {}, set(), [y.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            name = expert_params.get(id(getattr(child, "variable", None)))
            if name is not None:
                consumers.setdefault(name, []).append(type(node).__name__)
            stack.append(child)
    assert set(consumers) == set(expert_params.values())
    assert all(len(nodes) == 1 for nodes in consumers.values()), consumers


def test_copy_of_one_ffn_is_the_dense_ffn():
    g = torch.Generator().manual_seed(3)
    dense = FFNWeights(w_up=torch.randn(12, 8, generator=g), w_gate=torch.randn(12, 8, generator=g),
                       w_down=torch.randn(8, 12, generator=g), activation="silu")
    layer = MoELayer.from_init(dense.repeat(4), torch.randn(4, 8, generator=g), top_k=2)
    x = torch.randn(50, 8, generator=g)
    torch.testing.assert_close(layer(x), dense(x), atol=1e-5, rtol=1e-5)


def test_routing_record():
    layer = random_layer(E=4, K=2).to(torch.bfloat16)
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    layer(x)
    rec = layer.last_record
    assert rec.logits_TE.dtype == torch.float32 and rec.logits_TE.shape == (6, 4)
    assert rec.topk_ids_TK.shape == (6, 2) and rec.kept_TK is None and rec.mask_T is None
    torch.testing.assert_close(rec.topk_weights_TK.sum(-1), torch.ones(6))
    assert torch.equal(rec.topk_ids_TK, rec.probs_TE.topk(2).indices)
    assert rec.logits_TE.requires_grad


def test_raw_topk_weights_are_softmax_probabilities():
    layer = random_layer(normalize_topk=False)
    layer(torch.randn(10, 8))
    rec = layer.last_record
    torch.testing.assert_close(rec.topk_weights_TK, rec.probs_TE.gather(-1, rec.topk_ids_TK))


def test_capacity_first_come_first_serve_top1_before_top2():
    # token t's (top-1, top-2): t0 (0,1) t1 (0,1) t2 (1,0) t3 (0,2); capacity 2 per expert.
    ids = torch.tensor([[0, 1], [0, 1], [1, 0], [0, 2]])
    kept = capacity_keep(ids, num_experts=3, capacity=2)
    # top-1 pass: expert 0 gets t0, t1 (full) -> t3's top-1 dropped; expert 1 gets t2.
    # top-2 pass: t0 -> expert 1 (2nd slot), t1 -> expert 1 (full: dropped), t2 -> expert 0 (full), t3 -> 2.
    assert kept.tolist() == [[True, True], [True, False], [True, False], [False, True]]


def test_capacity_ignores_padding():
    ids = torch.tensor([[0], [0], [0]])
    kept = capacity_keep(ids, num_experts=2, capacity=1, mask_T=torch.tensor([False, True, True]))
    assert kept.view(-1).tolist() == [False, True, False]


def test_capacity_drop_gives_zero_and_renormalization():
    layer = random_layer(E=2, K=1, capacity_factor_eval=0.5)   # capacity ceil(0.5 * T * 1 / 2)
    layer.eval()
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 10.0   # everyone prefers expert 0
    x = torch.randn(8, 8).abs() + 0.1
    y = layer(x)
    cap = math.ceil(0.5 * 8 * 1 / 2)
    kept = layer.last_record.kept_TK.view(-1)
    assert kept.tolist() == [True] * cap + [False] * (8 - cap)
    assert torch.all(y[~kept] == 0)                        # a dropped token gets no FFN output
    layer.train()
    assert layer.last_record is not None and layer.capacity(8) is None   # separate train factor (None)


def test_renormalize_after_drop():
    layer = random_layer(E=3, K=2, capacity_factor_eval=0.4, renormalize_after_drop=True).eval()
    layer(torch.randn(20, 8, generator=torch.Generator().manual_seed(4)))
    rec = layer.last_record
    partial = rec.kept_TK.any(-1)
    torch.testing.assert_close(rec.topk_weights_TK[partial].sum(-1), torch.ones(int(partial.sum())))
    assert torch.all(rec.topk_weights_TK[~rec.kept_TK] == 0)


def test_padding_mask_is_recorded():
    layer = random_layer()
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    with padding_mask(mask):
        layer(torch.randn(2, 3, 8))
    assert layer.last_record.mask_T.tolist() == [True, True, False, True, False, False]
    layer(torch.randn(2, 3, 8))
    assert layer.last_record.mask_T is None


def test_selection_bias_changes_choice_not_weights():
    layer = random_layer(E=4, K=1, normalize_topk=False)
    x = torch.randn(30, 8)
    layer(x)
    probs = layer.last_record.probs_TE.detach()
    layer.selection_bias[3] = 10.0
    layer(x)
    rec = layer.last_record
    assert torch.all(rec.topk_ids_TK == 3)
    torch.testing.assert_close(rec.topk_weights_TK[:, 0], probs[:, 3])


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="top_k"):
        random_layer(E=2, K=3)
    with pytest.raises(ValueError, match="capacity_factor_train"):
        random_layer(capacity_factor_train=0.0)


def test_spec_rebuilds_the_same_structure():
    layer = random_layer(bias=True, shared=1, capacity_factor_train=2.0, normalize_topk=False)
    rebuilt = MoELayer.from_spec(layer.spec())
    assert {n: p.shape for n, p in rebuilt.state_dict().items()} == {n: p.shape for n, p in layer.state_dict().items()}
    rebuilt.load_state_dict(layer.state_dict())
    x = torch.randn(9, 8)
    torch.testing.assert_close(rebuilt(x), layer(x))


@pytest.mark.parametrize("activation", ["silu", "gelu_new", "sigmoid", "linear"])
def test_any_named_activation_trains(kernel_path, activation):
    """The kernel takes the activation's derivative from autograd, so every ACT2FN name works."""
    g = torch.Generator().manual_seed(8)
    experts = FFNWeights(w_up=torch.randn(3, 12, 8, generator=g), w_gate=torch.randn(3, 12, 8, generator=g),
                         w_down=torch.randn(3, 8, 12, generator=g), activation=activation)
    layer = MoELayer.from_init(experts, torch.randn(3, 8, generator=g), top_k=2)
    x = torch.randn(10, 8, generator=g)
    layer(x).square().sum().backward()
    ours = layer.experts.w_gate_up.grad.clone()
    layer.zero_grad()
    reference(layer, x).square().sum().backward()
    torch.testing.assert_close(ours, layer.experts.w_gate_up.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tokens", [1, 64, 2048, 65536, 2**22])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_path_rule_follows_the_devices_facts(tokens, dtype):
    """grouped_mm wherever torch has it for the device and its working set fits in its share of the device's
    memory, else the loop; rows it cannot address, and devices without grouped_mm, take the loop."""
    from upcycle.core.grouped_ffn import GROUPED_MEMORY_SHARE, choose_path, grouped_working_bytes

    w_in, w_down = (8, 2 * 1536, 576), (8, 576, 1536)         # SmolLM2's FFN, 8 experts (fused gate/up)
    slots = 2 * tokens                                          # top-2
    need = grouped_working_bytes(slots, w_in, w_down, dtype)
    for device in ("cpu", "cuda"):
        for memory in (24 * 2**30, 80 * 2**30, 141 * 2**30):
            expected = "grouped_mm" if need <= GROUPED_MEMORY_SHARE * memory else "loop"
            assert choose_path(slots, w_in, w_down, dtype, device_type=device, memory=memory) == expected
    assert choose_path(slots, w_in, w_down, dtype, device_type="cpu", memory=2**50) == "grouped_mm"
    assert choose_path(slots, w_in, w_down, dtype, device_type="cpu", memory=need * 7) == "loop"
    assert choose_path(slots, w_in, w_down, dtype, device_type="mps", memory=2**50) == "loop"
    assert choose_path(slots, w_in, w_down, dtype, device_type="cuda", memory=2**50, has_grouped_mm=False) == "loop"
    # rows grouped_mm cannot address (a stride that is not a multiple of 16 bytes) take the loop anywhere
    for device in ("cpu", "cuda"):
        assert choose_path(slots, (8, 2 * 5, 7), (8, 7, 5), dtype, device_type=device, memory=2**50) == "loop"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the CPU allocator keeps no peak")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_working_set_estimate_bounds_what_the_grouped_path_allocates(dtype):
    """The rule's estimate against the peak the grouped path's forward and backward allocate beyond the batch and
    the weights: at least that peak (so a batch that fits by the estimate fits), at most 3x it."""
    from upcycle.core.grouped_ffn import forced_kernel_path, grouped_working_bytes

    layer = random_layer(E=8, K=2, D=512, F=256).to("cuda", dtype)
    x = torch.randn(4096, 512, device="cuda", dtype=dtype, requires_grad=True)
    with forced_kernel_path("grouped_mm"):
        layer(x).float().square().mean().backward()         # warm-up: workspaces, cuBLAS handles
        layer.zero_grad(set_to_none=True)
        x.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        layer(x).float().square().mean().backward()
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    estimate = grouped_working_bytes(4096 * 2, layer.experts.w_in.shape, layer.experts.w_down.shape, dtype)
    assert peak <= estimate <= 3 * peak, (peak, estimate)


@pytest.mark.parametrize("shared", [0, 1])
def test_float32_inputs_to_bfloat16_experts_compute_in_float32(monkeypatch, shared):
    """The streaming conversion checks a bfloat16 layer on float32 hidden states: the experts must compute in
    float32 (type promotion), which equals the float32 copy of the layer exactly (bf16 -> f32 is exact), through
    the loop that casts one expert at a time, even for a batch small enough for grouped_mm (which would cast the
    whole stack)."""
    import upcycle.core.grouped_ffn as kernel
    calls = []
    run_grouped = kernel._run_grouped_mm
    monkeypatch.setattr(kernel, "_run_grouped_mm",
                        lambda x, slots, ffn: calls.append(ffn.w_in.dtype) or run_grouped(x, slots, ffn))
    layer = random_layer(E=4, K=2, bias=True, shared=shared).to(torch.bfloat16)
    layer.router.float()          # the router is float32 in every model (MoELayer's rule)
    wide = random_layer(E=4, K=2, bias=True, shared=shared)
    wide.load_state_dict({k: v.float() for k, v in layer.state_dict().items()})
    x = torch.randn(40, 8)
    with torch.no_grad():
        y = layer(x)
        assert y.dtype == torch.float32
        assert not calls                # the bfloat16 layer took the loop
        assert torch.equal(y, wide(x))
        assert calls                    # the float32 one, this small batch, grouped_mm: the same numbers
        # bfloat16 inputs still compute in bfloat16
        assert layer(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("capacity", [None, 1.0])
@pytest.mark.parametrize("shared", [0, 1])
def test_a_batch_run_in_token_chunks_computes_what_one_call_computes(monkeypatch, capacity, shared):
    """On the CPU the experts run on token ranges of a bounded working set (`tokens_per_call`); the routing stays
    the whole batch's (capacity counts over all of it), so the chunks compute the same outputs and gradients."""
    import upcycle.core.grouped_ffn as kernel

    layer = random_layer(shared=shared, capacity_factor_train=capacity, capacity_factor_eval=capacity).train()
    x = torch.randn(2, 13, 8, generator=torch.Generator().manual_seed(3))
    results = []
    for budget in (2**40, 1):           # one call, and one token per call
        monkeypatch.setattr(kernel, "CPU_CHUNK_BYTES", budget)
        layer.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        y = layer(xx)
        y.square().sum().backward()
        results.append((y.detach(), xx.grad, layer.experts.w_gate_up.grad.clone(), layer.router.weight.grad.clone()))
    assert kernel.tokens_per_call(26, 2, (4, 24, 8), (4, 8, 12), torch.float32, torch.device("cpu")) == 1
    # gradients summed over chunks add in another order: float32 rounding, the bound of this file's gradient tests
    for one, chunked in zip(results[0], results[1], strict=True):
        torch.testing.assert_close(chunked, one, atol=1e-5, rtol=1e-4)
    # on a GPU a batch is one call
    monkeypatch.setattr(kernel, "CPU_CHUNK_BYTES", 1)
    assert kernel.tokens_per_call(26, 2, (4, 24, 8), (4, 8, 12), torch.float32, torch.device("cuda")) == 26
