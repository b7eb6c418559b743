"""Several fine-tuned models of one base merged into one MoE : expert i is source i's FFN, the `data`
router separates separable sources, mismatched sources are refused before a weight is read, the stock export
computes what our folder computes, and only the FFN tensors of the MoE blocks are read from the sources."""

from __future__ import annotations

import gc
import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from conftest import TOY_WORDS, fine_tune, make_tiny, write_tiny_lm
from upcycle import ConvertConfig, MoEConfig, convert
from upcycle.checkpoint.reader import CheckpointReader
from upcycle.checkpoint.upcycle_format import load
from upcycle.cli import parser
from upcycle.commands.convert import convert_config
from upcycle.config import CalibrationConfig, CheckConfig, ExpertSource, PlacementConfig, SourcesConfig
from upcycle.conversion import merge, streaming
from upcycle.core.moe import moe_layers
from upcycle.errors import UpcycleError

PROJ = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def family_of_models(tmp_path_factory):
    """(base folder, three fine-tunes, train text, held-out text) of the tiny Llama."""
    root = tmp_path_factory.mktemp("btx")
    dense, train, held = write_tiny_lm(root)
    sources = [fine_tune(dense, root / f"ft{i}", seed=100 + i, attention=True) for i in range(3)]
    return dense, sources, train, held


def _cfg(dense, sources, held, **sources_kwargs) -> ConvertConfig:
    experts = tuple(ExpertSource(model=str(s), data=str(held)) for s in sources)
    return ConvertConfig(model=str(dense), moe=MoEConfig(num_experts=len(sources), top_k=2),
                         placement=PlacementConfig(every=2), check=CheckConfig(text=str(held)),
                         calibration=CalibrationConfig(tokens=2048),
                         sources=SourcesConfig(experts=experts, **sources_kwargs))


def _tensors(folder) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(folder)
    return {name: reader.get(name) for name in reader.names()}


@pytest.mark.parametrize("non_ffn", ["base", "average"])
def test_expert_i_is_source_i_ffn_and_the_rest_is_the_base_or_the_average(family_of_models, tmp_path, non_ffn):
    dense, sources, _, held = family_of_models
    report = convert(_cfg(dense, sources, held, non_ffn=non_ffn, shared_expert=True), tmp_path / "out",
                     progress=False).report.to_dict()
    out, base = _tensors(tmp_path / "out"), _tensors(dense)
    fts = [_tensors(s) for s in sources]
    for block in (1, 3):                   # every=2: blocks 1 and 3 are MoE
        p = f"model.layers.{block}.mlp"
        for i, ft in enumerate(fts):
            assert torch.equal(out[f"{p}.experts.w_gate_up"][i],
                               torch.cat([ft[f"{p}.gate_proj.weight"], ft[f"{p}.up_proj.weight"]]))
            assert torch.equal(out[f"{p}.experts.w_down"][i], ft[f"{p}.down_proj.weight"])
        # the shared expert is the base's FFN
        assert torch.equal(out[f"{p}.shared_experts.w_gate_up"][0],
                           torch.cat([base[f"{p}.gate_proj.weight"], base[f"{p}.up_proj.weight"]]))
        assert torch.equal(out[f"{p}.shared_experts.w_down"][0], base[f"{p}.down_proj.weight"])
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.2.mlp.up_proj.weight",
                 "model.embed_tokens.weight", "model.layers.3.input_layernorm.weight"):
        expected = base[name] if non_ffn == "base" else torch.stack([ft[name] for ft in fts]).mean(0)
        # the average: three float32 tensors summed in float32 and divided, as the reader does (same order)
        assert torch.allclose(out[name], expected, rtol=0, atol=1e-7), name
        if non_ffn == "base":
            assert torch.equal(out[name], expected), name
    # the merged folder loads and runs; the report says where each expert came from and checks each copy
    model = load(tmp_path / "out")
    assert model(torch.tensor([[3, 4, 5]])).logits.isfinite().all()
    assert report["sources"]["expert_source"] == [0, 1, 2]
    assert all(d == 0.0 for layer in report["layers"] for d in layer["expert_vs_source_max_abs_diff"].values())


def _separable(root):
    """A base whose residual stream is its embedding at every depth (attention and FFN outputs zeroed), whose
    words of the first half of TOY_WORDS embed near +v and of the second half near -v; two fine-tunes, each with
    text in one half only. The FFN inputs of the two sources' tokens are then separated by the plane normal to v
    at every MoE layer."""
    dense, _, _ = write_tiny_lm(root)
    tokenizer = transformers.AutoTokenizer.from_pretrained(dense)
    model = transformers.AutoModelForCausalLM.from_pretrained(dense)
    halves = [TOY_WORDS[: len(TOY_WORDS) // 2], TOY_WORDS[len(TOY_WORDS) // 2:]]
    generator = torch.Generator().manual_seed(0)
    v = torch.randn(model.config.hidden_size, generator=generator)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        embed = model.get_input_embeddings().weight
        for sign, words in zip((1.0, -1.0), halves, strict=True):
            for word in words:
                (token,) = tokenizer(word, add_special_tokens=False)["input_ids"]
                embed[token] = sign * v + 0.1 * torch.randn(v.shape, generator=generator)
    model.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    sources, data = [], []
    rng = torch.Generator().manual_seed(1)
    for i, words in enumerate(halves):
        docs = [" ".join(words[j] for j in torch.randint(len(words), (20,), generator=rng).tolist())
                for _ in range(60)]
        (root / f"text{i}.txt").write_text("\n\n".join(docs))
        data.append(root / f"text{i}.txt")
        sources.append(fine_tune(root / "base", root / f"ft{i}", seed=i))
    return root / "base", sources, data


def test_the_data_router_on_separable_sources_agrees_with_the_source_everywhere(tmp_path):
    base, sources, data = _separable(tmp_path)
    experts = tuple(ExpertSource(model=str(s), data=str(d)) for s, d in zip(sources, data, strict=True))
    cfg = ConvertConfig(model=str(base), moe=MoEConfig(num_experts=2, top_k=1), placement=PlacementConfig(every=1),
                        sources=SourcesConfig(experts=experts, router="data", held_out=0.2))
    report = convert(cfg, tmp_path / "out", progress=False).report.to_dict()
    assert len(report["layers"]) == 4
    for layer in report["layers"]:
        assert set(layer["agreement"].values()) == {1.0}, layer
    # the merged model itself, on each source's text: every token's top-1 expert, in every layer, is its source's
    model = load(tmp_path / "out")
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    for i, path in enumerate(data):
        # the words only: the special tokens are in neither half
        ids = tokenizer(path.read_text().split("\n\n")[0], add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            model(ids)
        tops = [layer.last_record.topk_ids_TK[:, 0] for layer in moe_layers(model).values()]
        assert len(tops) == 4 and all(bool((top == i).all()) for top in tops), (i, tops)
    # the random router, for contrast, is not the sources' split
    cfg = ConvertConfig(**{**cfg.__dict__, "sources": SourcesConfig(experts=experts, router="random")})
    report = convert(cfg, tmp_path / "random", progress=False).report.to_dict()
    assert min(min(layer["agreement"].values()) for layer in report["layers"]) < 1.0


def test_analyze_reads_a_merged_models_own_sources_and_reports_router_source_agreement(tmp_path):
    """Item 4: `upcycle analyze` on a merge, with no --source, reads each source's held-out documents (the
    merge's own split, recorded in its report) and reports per-source agreement; --source still overrides."""
    from upcycle.analyze.run import AnalyzeOptions, analyze

    base, sources, data = _separable(tmp_path)
    experts = tuple(ExpertSource(model=str(s), data=str(d)) for s, d in zip(sources, data, strict=True))
    cfg = ConvertConfig(model=str(base), moe=MoEConfig(num_experts=2, top_k=1), placement=PlacementConfig(every=2),
                        sources=SourcesConfig(experts=experts, router="data", held_out=0.2))
    report = convert(cfg, tmp_path / "merged", progress=False).report.to_dict()
    names = [e["name"] for e in report["sources"]["experts"]]
    assert names == ["0-ft0", "1-ft1"]
    options = AnalyzeOptions(tokens=64, sequence_length=16, output_tokens=32, shuffles=2)
    result = analyze(str(tmp_path / "merged"), str(tmp_path / "analysis"), options, progress=False)
    inputs = result["inputs"]
    assert inputs["sources_from"] == "the merge's sources" and inputs["expert_source"] == [0, 1]
    # 60 documents a source, 0.2 held out: the 12 the merge measured its agreement on, not the 48 it calibrated on
    assert [(s["name"], s["documents_available"]) for s in inputs["sources"]] == [(n, 12) for n in names]
    layers = result["snapshots"][0]["layers"]
    assert len(layers) == 2
    # every word token goes to its source's expert; the EOS that ends each packed document is in neither half
    # (its embedding is the base's random one), so at most those tokens disagree
    floor = {s["name"]: 1 - s["documents"] / s["tokens"] for s in inputs["sources"]}
    for layer in layers.values():
        agreement = layer["specialization"]["source_agreement"]
        assert set(agreement) == set(names) and all(floor[n] <= agreement[n] <= 1 for n in names), agreement
    assert "source agreement" in (tmp_path / "analysis" / "report.html").read_text()
    # the user's sources replace the merge's; without the merge's sources there is no agreement to report
    options = AnalyzeOptions(sources=(f"words={data[0]}",), tokens=64, sequence_length=16, output_tokens=32,
                             shuffles=2)
    result = analyze(str(tmp_path / "merged"), str(tmp_path / "own"), options, progress=False)
    assert result["inputs"]["sources_from"] == "--source/--data" and result["inputs"]["expert_source"] is None
    assert all("source_agreement" not in m["specialization"] for m in result["snapshots"][0]["layers"].values())


def test_the_prompts_router_follows_the_prompts_minus_the_negatives(tmp_path):
    base, sources, data = _separable(tmp_path)
    halves = [TOY_WORDS[: len(TOY_WORDS) // 2], TOY_WORDS[len(TOY_WORDS) // 2:]]
    experts = tuple(ExpertSource(model=str(s), data=str(d), prompts=(" ".join(w),), negative_prompts=(" ".join(o),))
                    for s, d, w, o in zip(sources, data, halves, halves[::-1], strict=True))
    cfg = ConvertConfig(model=str(base), moe=MoEConfig(num_experts=2, top_k=1), placement=PlacementConfig(every=2),
                        sources=SourcesConfig(experts=experts, router="prompts"))
    report = convert(cfg, tmp_path / "out", progress=False).report.to_dict()
    for layer in report["layers"]:
        assert set(layer["agreement"].values()) == {1.0}, layer
        assert layer["router_rows_max_cosine"] < 0          # opposite halves: rows point apart


def _refused_before_reading(monkeypatch, cfg, tmp_path, match: str):
    """The conversion fails with `match`, and no tensor of any checkpoint was read."""
    def no_reading(self, name):
        raise AssertionError(f"read {name} from {self.folder} before refusing")

    monkeypatch.setattr(CheckpointReader, "get", no_reading)
    with pytest.raises(UpcycleError, match=match):
        convert(cfg, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_source_of_another_architecture_is_refused_before_reading(family_of_models, tmp_path, monkeypatch):
    dense, sources, _, held = family_of_models
    qwen = tmp_path / "qwen"
    make_tiny("qwen2").save_pretrained(qwen)
    cfg = _cfg(dense, [sources[0], qwen], held)
    _refused_before_reading(monkeypatch, cfg, tmp_path, r"experts\[1\].*model_type: base 'llama', source 'qwen2'")


def test_a_source_of_other_sizes_is_refused_before_reading(family_of_models, tmp_path, monkeypatch):
    dense, sources, _, held = family_of_models
    wide = tmp_path / "wide"
    config = transformers.AutoConfig.from_pretrained(dense)
    config.intermediate_size = 48
    transformers.LlamaForCausalLM(config).save_pretrained(wide)
    cfg = _cfg(dense, [wide, sources[1]], held)
    _refused_before_reading(monkeypatch, cfg, tmp_path, r"experts\[0\].*intermediate_size: base 64, source 48")


def test_a_tensor_of_another_shape_is_refused_by_name_before_reading(family_of_models, tmp_path, monkeypatch):
    """The config agrees, the weights file does not: the safetensors header names the tensor."""
    dense, sources, _, held = family_of_models
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((dense / "config.json").read_text())
    tensors = _tensors(sources[2])
    tensors["model.layers.2.mlp.up_proj.weight"] = tensors["model.layers.2.mlp.up_proj.weight"][:60].clone()
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    cfg = _cfg(dense, [sources[0], bad], held)
    _refused_before_reading(monkeypatch, cfg, tmp_path,
                            r"tensor model.layers.2.mlp.up_proj.weight: base shape \[64, 32\], source shape \[60, 32\]")
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    tensors["model.layers.2.mlp.up_proj.weight"] = tensors["model.layers.2.mlp.up_proj.weight"][:0]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    _refused_before_reading(monkeypatch, cfg, tmp_path,
                            r"tensor model.layers.0.self_attn.k_proj.weight is in the base but not in the source")


@pytest.mark.parametrize(("export_class", "shared"), [("mixtral", False), ("qwen2_moe", True)])
def test_the_stock_export_reproduces_our_merged_model(family_of_models, tmp_path, monkeypatch, export_class,
                                                      shared):
    dense, sources, _, held = family_of_models
    ours_cfg = _cfg(dense, sources, held, shared_expert=shared)
    placement = PlacementConfig(every=1) if export_class == "mixtral" else PlacementConfig(every=2)
    ours_cfg = ConvertConfig(**{**ours_cfg.__dict__, "placement": placement})
    convert(ours_cfg, tmp_path / "ours", progress=False)
    stock_cfg = ConvertConfig(**{**ours_cfg.__dict__, "export": "hf", "export_class": export_class})
    writers = []
    real_writer = streaming.ShardedWriter

    def writer(directory, specs, **kwargs):
        writers.append(sorted(name for name, _, _ in specs))
        return real_writer(directory, specs, **kwargs)

    monkeypatch.setattr(streaming, "ShardedWriter", writer)
    report = convert(stock_cfg, tmp_path / "stock", progress=False).report.to_dict()
    assert report["export"]["model_type"] == export_class and report["export"]["check"]["checked"]
    # written once, in the stock layout (no folder of ours first): the one writer's plan is the stock folder's
    assert writers == [sorted(CheckpointReader(tmp_path / "stock").names())]
    assert sorted(p.name for p in (tmp_path / "stock").iterdir() if p.is_dir()) == []
    ours = load(tmp_path / "ours")
    stock = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "stock").eval()
    assert type(stock).__name__ == {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}[export_class]
    ids = torch.randint(3, 25, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(ids).logits - stock(ids).logits).abs().max().item()
    # the same float32 weights through the same operations, the experts' sums in another order at most: a few
    # float32 ulps of logits of size ~1 (measured: 0); 1e-5 is check.export_tolerance's default
    assert diff <= 1e-5


def test_a_stock_export_unlike_our_outputs_on_the_probe_is_refused_and_nothing_is_written(family_of_models, tmp_path,
                                                                                          monkeypatch):
    """The check compares the stock model with our outputs taken through the blocks as they were written: when
    they differ (here ours are moved by 1e-3 after the fact), the merge fails and leaves no output."""
    from upcycle.conversion.merged_probe import ProbeThroughBlocks
    from upcycle.probe import ProbeOutput

    dense, sources, _, held = family_of_models
    cfg = ConvertConfig(**{**_cfg(dense, sources, held).__dict__, "export": "hf", "export_class": "qwen2_moe"})
    taken = []
    real_output = ProbeThroughBlocks.output

    def moved(self):
        out = real_output(self)
        taken.append(out)
        return ProbeOutput(out.values_NC + 1e-3, out.name, out.is_distribution)

    monkeypatch.setattr(ProbeThroughBlocks, "output", moved)
    with pytest.raises(UpcycleError, match="differ from ours by 0.001"):
        convert(cfg, tmp_path / "stock", progress=False)
    assert not (tmp_path / "stock").exists() and len(taken) == 1
    monkeypatch.undo()
    report = convert(ConvertConfig(**{**cfg.__dict__, "check": CheckConfig(text=str(held), end_to_end=False)}),
                     tmp_path / "unchecked", progress=False).report.to_dict()
    assert report["export"]["check"] == {"checked": False, "why_not": "check.end_to_end: false"}


def test_only_the_ffns_of_the_moe_blocks_are_read_from_the_sources(family_of_models, tmp_path, monkeypatch):
    dense, sources, _, held = family_of_models
    reads: list[tuple[str, str]] = []
    get = CheckpointReader.get

    def logged(self, name):
        reads.append((str(self.folder), name))
        return get(self, name)

    monkeypatch.setattr(CheckpointReader, "get", logged)
    convert(_cfg(dense, sources, held), tmp_path / "out", progress=False)
    for source in sources:
        names = sorted(name for folder, name in reads if folder == str(source))
        assert names == sorted(f"model.layers.{b}.mlp.{p}.weight" for b in (1, 3) for p in PROJ)


def test_recipes_and_flags_of_several_sources(family_of_models, tmp_path):
    dense, sources, train, held = family_of_models
    recipe = tmp_path / "btx.yaml"
    recipe.write_text(f"sources:\n  router: prompts\n  experts:\n"
                      f"    - {{model: {sources[0]}, prompts: [cat dog], count: 2}}\n"
                      f"    - {{model: {sources[1]}, prompts: [red blue], negative_prompts: [cat]}}\n")
    cfg = convert_config(parser(every_command=True).parse_args(["convert", str(dense), "out", "--config", str(recipe)]))
    assert cfg.moe.num_experts == 3 and cfg.sources.experts[0].count == 2
    assert cfg.sources.experts[1].negative_prompts == ("cat",) and cfg.sources.router == "prompts"
    args = parser(every_command=True).parse_args(["convert", str(dense), "out", "--expert", f"{sources[0]}={train}",
                                 "--expert", str(sources[1]), "--router", "random", "--non-ffn", "average"])
    cfg = convert_config(args)
    assert [(e.model, e.data) for e in cfg.sources.experts] == [(str(sources[0]), str(train)), (str(sources[1]), None)]
    assert (cfg.moe.num_experts, cfg.sources.router, cfg.sources.non_ffn) == (2, "random", "average")
    # count 2 from one source with drop: 3 experts, the two of source 0 differ and are not its FFN
    cfg = ConvertConfig(**{**_cfg(dense, sources[:2], held).__dict__, "method": "drop",
                           "moe": MoEConfig(num_experts=3, top_k=2),
                           "sources": SourcesConfig(experts=(ExpertSource(model=str(sources[0]), data=str(held),
                                                                          count=2),
                                                             ExpertSource(model=str(sources[1]), data=str(held))))})
    report = convert(cfg, tmp_path / "drop", progress=False).report.to_dict()
    assert report["sources"]["expert_source"] == [0, 0, 1]
    w = _tensors(tmp_path / "drop")["model.layers.1.mlp.experts.w_down"]
    assert not torch.equal(w[0], w[1])
    assert json.loads((tmp_path / "drop" / "upcycle_config.json").read_text())["layers"][0]["num_experts"] == 3


@pytest.mark.parametrize(("change", "match"), [
    ({"moe": MoEConfig(num_experts=4, top_k=2)}, "moe.num_experts must be 3"),
    ({"sources": SourcesConfig(experts=(ExpertSource(model="x"),) * 3, router="data")}, "needs each source's text"),
    ({"sources": SourcesConfig(experts=(ExpertSource(model="x"),) * 3, router="prompts")},
     "needs each source's prompts"),
    ({"sources": SourcesConfig(experts=(ExpertSource(model="x", data="no-such-file"),) * 3)},
     "data no-such-file: no such file"),
    ({"streaming": False}, "always streams"),
])
def test_a_recipe_that_cannot_merge_is_refused_first(family_of_models, tmp_path, change, match):
    dense, sources, _, held = family_of_models
    cfg = ConvertConfig(**{**_cfg(dense, sources, held).__dict__, **change})
    with pytest.raises(UpcycleError, match=match):
        convert(cfg, tmp_path / "out", progress=False)


def test_an_unknown_router_is_refused_when_the_config_is_made():
    with pytest.raises(UpcycleError, match="sources.router must be one of random, prompts, data, got 'learned'"):
        SourcesConfig(experts=(ExpertSource(model="x"),) * 3, router="learned")


def _alive() -> list[torch.Tensor]:
    """Every tensor with real storage that Python can reach (the autograd graph's saved tensors included: each
    keeps its Python object while the graph lives)."""
    from torch._subclasses.fake_tensor import FakeTensor

    gc.collect()
    # fake tensors (left by a torch.compile trace in this process) hold no memory
    return [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and not o.is_meta
            and not isinstance(o, FakeTensor)]


def test_the_merge_holds_one_block_of_the_sources_at_a_time(family_of_models, tmp_path, monkeypatch):
    """Streaming: while block b is merged, each source gives block b's FFN tensors and
    nothing else; once the block is written nothing of it stays alive, so what is alive after the last block is
    what was alive after the first, whatever the depth (a replay that kept its autograd graph kept every block's
    weights and activations: 12 GB for three 135M sources)."""
    dense, sources, _, held = family_of_models
    block, reads, alive = [0], [], []
    get, release = CheckpointReader.get, streaming.release

    def logged(self, name):
        reads.append((block[0], str(self.folder), name))
        return get(self, name)

    def counted(module):
        release(module)
        if module is merged_model[0]:       # the trunk, released once the first block's inputs are recorded
            return
        # the model's own buffers stay by design (a router's selection bias, E numbers a layer)
        buffers = {id(b) for b in merged_model[0].buffers()}
        tensors = [t for t in _alive() if id(t) not in buffers]
        # the FFN's [F, D] and [D, F] shapes (64 x 32 here): a source's projections, or the layer's stacked experts;
        # counted among the tensors the merge made (an earlier test in this worker may keep tiny models of its own)
        ffn_shaped = [t for t in tensors if t.shape[-2:] in ((64, 32), (32, 64)) and id(t) not in before]
        alive.append((len(tensors), sum(t.numel() for t in tensors), len(ffn_shaped)))
        block[0] += 1

    monkeypatch.setattr(CheckpointReader, "get", logged)
    monkeypatch.setattr(streaming, "release", counted)
    merged_model = []
    empty = merge.empty_model
    monkeypatch.setattr(merge, "empty_model", lambda *a: merged_model.append(empty(*a)) or merged_model[0])
    monkeypatch.setattr(streaming, "write_queue_bytes", lambda _: 0)     # written at once: no tensor waits in a queue
    cfg = ConvertConfig(**{**_cfg(dense, sources, held, router="data").__dict__,
                           "placement": PlacementConfig(every=1)})
    before = {id(t) for t in _alive()}
    convert(cfg, tmp_path / "out", progress=False)
    assert len(alive) == 4
    for b in range(4):
        for source in sources:
            names = sorted(name for at, folder, name in reads if at == b and folder == str(source))
            assert names == sorted(f"model.layers.{b}.mlp.{p}.weight" for p in PROJ), (b, source)
    assert all(n_ffn == 0 for _, _, n_ffn in alive), alive
    assert alive[-1][:2] == alive[0][:2], alive


def test_the_report_counts_the_base_before_and_the_merged_model_after(family_of_models, tmp_path):
    """`parameters.before` is the base model's count, taken before any block is converted (not the base's
    skeleton with the merged layers installed in it), and `after` the merged model's."""
    import upcycle

    dense, sources, _, held = family_of_models
    report = convert(_cfg(dense, sources, held), tmp_path / "out", progress=False).report.to_dict()
    count = lambda model: sum(p.numel() for p in model.parameters())   # noqa: E731
    base = transformers.AutoModelForCausalLM.from_pretrained(dense)
    assert report["parameters"]["before"] == {"total": count(base), "active_per_token": count(base)}
    assert report["parameters"]["after"]["total"] == count(upcycle.load(tmp_path / "out"))


def _with_tokenizer(folder, tokenizer) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def test_a_source_whose_tokenizer_differs_by_one_token_is_refused_with_the_token_named(family_of_models, tmp_path,
                                                                                       monkeypatch):
    """The base's tokenizer reads every source's text, and with `non_ffn: average` the embeddings are averaged:
    a source with another token map is refused, the token named, before any tensor is read."""
    import shutil

    dense, sources, _, held = family_of_models
    base_vocab = transformers.AutoTokenizer.from_pretrained(dense).get_vocab()
    renamed = tmp_path / "renamed"
    shutil.copytree(sources[1], renamed)
    tokenizer_json = json.loads((renamed / "tokenizer.json").read_text())
    vocab = tokenizer_json["model"]["vocab"]
    word = next(t for t in sorted(vocab, key=vocab.get) if not t.startswith("["))   # one ordinary word
    vocab["zzzword"] = vocab.pop(word)
    (renamed / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    cfg = _cfg(dense, [sources[0], renamed], held, non_ffn="average")
    _refused_before_reading(monkeypatch, cfg, tmp_path, rf"experts\[1\] .* does not share the base's tokenizer .*: "
                                                        rf"token '{word}' \(id {base_vocab[word]} in the base\) is not "
                                                        rf"in the source's vocabulary")
    absent = tmp_path / "absent"
    shutil.copytree(sources[1], absent)
    _with_tokenizer(absent, None)
    _refused_before_reading(monkeypatch, _cfg(dense, [absent, sources[0]], held), tmp_path,
                            r"experts\[0\] .* the base has a tokenizer and the source has none")


def test_a_source_whose_config_differs_where_the_shared_weights_compute_is_refused(family_of_models, tmp_path,
                                                                                   monkeypatch):
    """rope_theta and rms_norm_eps shape no tensor but the function of the attention and the norms the merged
    model shares (or averages): a source that differs there is refused with both values; a field that says
    nothing about the function (use_cache, dtype) is not a difference."""
    import shutil

    dense, sources, _, held = family_of_models
    other = tmp_path / "eps"
    shutil.copytree(sources[2], other)
    config = json.loads((other / "config.json").read_text())
    config.update(use_cache=not config.get("use_cache", True), rms_norm_eps=1e-3)
    (other / "config.json").write_text(json.dumps(config))
    base_eps = json.loads((dense / "config.json").read_text())["rms_norm_eps"]
    _refused_before_reading(monkeypatch, _cfg(dense, [sources[0], other], held, non_ffn="average"), tmp_path,
                            rf"experts\[1\].*config.json rms_norm_eps: base {base_eps!r}, source 0.001")
    config["rms_norm_eps"] = base_eps
    (other / "config.json").write_text(json.dumps(config))
    from upcycle.conversion.sources import open_sources

    merge = _cfg(dense, [sources[0], other], held)
    assert len(open_sources(merge.model, merge.sources)[1]) == 2     # use_cache alone: accepted
