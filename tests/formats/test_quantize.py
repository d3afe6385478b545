"""`moetier quantize` (formats/quantize.py) and the quantized disk tier reader (formats/qtier.py).

Tiny checkpoints are built here with an expert intermediate size of 64: the conftest ones
(I = 16 or 48) have no int4/int2 group (multiples of 32) dividing I, which is itself tested.
Expected tensors are `quantize_expert` of the experts read by hand (conftest.canonical_experts_of);
a tier must hand back exactly those, whatever the family (per-expert, fused, with biases).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable
from io import StringIO
from pathlib import Path

import pytest
import torch
from rich.console import Console
from rich.progress import Progress
from safetensors.torch import load_file, save_file

from conftest import canonical_experts_of
from moetier.errors import CheckpointError, ConfigError
from moetier.formats import quantize as quantize_mod
from moetier.formats.diskio import DiskIO
from moetier.formats.qtier import QuantTier, list_tiers
from moetier.formats.quant import QMatrix, dequantize, quantize_expert
from moetier.formats.quantize import QuantEvent, quantize_model
from moetier.models.open import open_checkpoint, open_quant_tier
from moetier.models.tiny import build_tiny_checkpoint
from moetier.types import ExpertKey

INTER_ATTR = {"qwen3_moe": "moe_intermediate_size", "mixtral": "intermediate_size", "gpt_oss": "intermediate_size"}
ALL = ("int8", "int4", "int2")


@pytest.fixture(scope="module")
def ckpt64(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """ckpt64(family) -> a read-only tiny checkpoint whose experts have I = 64."""
    root, cache = tmp_path_factory.mktemp("tiny64"), {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = build_tiny_checkpoint(family, root / family, **{INTER_ATTR[family]: 64})
        return cache[family]

    return get


@pytest.fixture
def copy64(ckpt64: Callable[[str], Path], tmp_path: Path) -> Callable[[str], Path]:
    def get(family: str) -> Path:
        return Path(shutil.copytree(ckpt64(family), tmp_path / f"{family}_copy"))

    return get


def empty_like_specs(tier: QuantTier) -> dict[str, torch.Tensor]:
    return {name: torch.empty(shape, dtype=dt) for name, (dt, shape) in tier.tensor_specs.items()}


def events_into(log: list[QuantEvent]) -> Callable[[QuantEvent], None]:
    return log.append


def files_of(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.glob("layer-*.safetensors"))}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_tier_reads_back_exactly_what_quantize_expert_gives(family: str, ckpt64: Callable[[str], Path], tmp_path):
    src = ckpt64(family)
    paths = quantize_model(src, ALL, out=tmp_path)
    assert [p.name for p in paths] == ["int8-gK", "int4-g128", "int2-g64"]
    assert not (src / "moetier-quant").exists()  # `out` keeps the model folder untouched
    experts = canonical_experts_of(src, family)
    for precision, path in zip(ALL, paths, strict=True):
        tier = open_quant_tier(src, precision, root=tmp_path)
        assert tier.group_sizes == {"w13": 32, "w2": 64}
        files = {layer: load_file(path / f"layer-{layer:03d}.safetensors") for layer in tier.moe_layers}
        dest = empty_like_specs(tier)
        for io in (None, DiskIO(direct=True, depth=2)):  # plain pread, then O_DIRECT (formats/diskio.py)
            if io is not None:
                tier.set_io(io)
            for (layer, e), pieces in experts.items():
                assert tier.read_into(ExpertKey(layer, e), dest) == tier.expert_bytes
                want = quantize_expert(pieces, tier.spec)  # the default method, expert by expert
                assert set(want) == set(dest)
                for name, t in dest.items():
                    assert torch.equal(t, want[name].to(t.dtype)), (precision, layer, e, name)
                    assert torch.equal(files[layer][f"{e}.{name}"], t)  # a plain safetensors file too
        tier.close()


def test_batch_size_changes_no_byte_and_errors_are_measured(ckpt64: Callable[[str], Path], tmp_path, monkeypatch):
    """Experts are fitted in batches (BATCH_ELEMENTS); one expert per batch, or batches that do not
    divide the expert count, write the same files; the recorded error is the measured one."""
    src = ckpt64("gpt_oss")  # with biases
    ref = quantize_model(src, ALL, out=tmp_path / "ref")
    numel = open_checkpoint(src, "fp32", torch.device("cpu")).reader.layout.numel
    for size in (1, 4):  # 6 experts: batches of 1, and of 4 then 2
        monkeypatch.setattr(quantize_mod, "BATCH_ELEMENTS", size * numel)
        paths = quantize_model(src, ALL, out=tmp_path / str(size))
        for a, b in zip(ref, paths, strict=True):
            assert files_of(a) == files_of(b)
            recs = [json.loads((p / "manifest.json").read_text())["layers"] for p in (a, b)]
            for ra, rb in zip(*recs, strict=True):  # the same files; errors summed in another order
                assert ra["sha256"] == rb["sha256"]
                assert ra["error"] == pytest.approx(rb["error"], rel=1e-6)
    experts = canonical_experts_of(src, "gpt_oss")
    for precision, path in zip(ALL, ref, strict=True):
        tier = open_quant_tier(src, precision, root=tmp_path / "ref")
        dest = empty_like_specs(tier)
        sq = {"w13": [0.0, 0.0], "w2": [0.0, 0.0]}  # layer 0: squared error, squared norm
        for e in range(tier.num_experts):
            pieces = experts[(0, e)]
            tier.read_into(ExpertKey(0, e), dest)
            for m, w in (("w13", torch.cat([pieces["gate"], pieces["up"]])), ("w2", pieces["down"])):
                n, k = w.shape
                deq = dequantize(QMatrix(dest[f"{m}.q"], dest[f"{m}.scale"], dest[f"{m}.zero"], n, k, tier.spec))
                sq[m][0] += float((deq - w.float()).square().sum())
                sq[m][1] += float(w.float().square().sum())
        (rec,) = [r for r in json.loads((path / "manifest.json").read_text())["layers"] if r["layer"] == 0]
        for m, (err, ref_sq) in sq.items():
            assert rec["error"][m] == pytest.approx((err / ref_sq) ** 0.5, rel=1e-4), (precision, m)
        tier.close()


def test_manifest_records_layout_groups_and_errors(ckpt64: Callable[[str], Path], tmp_path):
    src = ckpt64("gpt_oss")
    (path,) = quantize_model(src, ["int4"], out=tmp_path, group_sizes={"int4": 64}, method="rtn")
    m = json.loads((path / "manifest.json").read_text())
    assert path.name == "int4-g64"
    assert (m["precision"], m["bits"], m["group"], m["method"], m["dtype"]) == ("int4", 4, "64", "rtn", "fp32")
    assert m["group_sizes"] == {"w13": 32, "w2": 64} and m["num_experts"] == 6 and m["complete"]
    assert m["layout"] == {"hidden": 32, "inter": 64, "has_bias": True} and m["moe_layers"] == [0, 1]
    assert [r["file"] for r in m["layers"]] == ["layer-000.safetensors", "layer-001.safetensors"]
    for rec in m["layers"]:
        assert 0.01 < rec["error"]["w13"] < 0.3 and 0.01 < rec["error"]["w2"] < 0.3
    (tier,) = list_tiers(src, root=tmp_path)
    assert tier["status"] == "ok" and tier["layers_done"] == 2 and tier["bytes"] > 0


def test_default_location_int8_on_conftest_checkpoints_and_int4_refused(ckpt_copy):
    src = ckpt_copy("deepseek_v3", "sharded")  # first layer dense; several shards
    (path,) = quantize_model(src, ["int8"])
    assert path == src / "moetier-quant" / "int8-gK"
    tier = open_quant_tier(src, "int8")
    assert tier.moe_layers == (1, 2) and tier.group_sizes == {"w13": 32, "w2": 16}
    opened = open_checkpoint(src, "auto", torch.device("cpu"))  # as the loader holds it: index and shape reused
    again = QuantTier.open(src, "int8", reader=opened.reader)
    assert (again.layout, again.num_experts, again.moe_layers) == (tier.layout, tier.num_experts, tier.moe_layers)
    with pytest.raises(ConfigError, match=r"shape \[32, 16\]"):
        quantize_model(src, ["int4"])  # I = 16: no group of 32 or more divides it


def test_resume_after_interruption_skips_done_layers_byte_identical(ckpt64: Callable[[str], Path], tmp_path):
    src = ckpt64("qwen3_moe")
    quantize_model(src, ["int4", "int2"], out=tmp_path / "ref")

    class Stop(Exception):
        pass

    def stop(ev: QuantEvent) -> None:
        raise Stop

    run = tmp_path / "run"
    with pytest.raises(Stop):
        quantize_model(src, ["int4", "int2"], out=run, progress=stop)
    with pytest.raises(CheckpointError, match=r"incomplete tier.*moetier quantize .* --precisions int4"):
        open_quant_tier(src, "int4", root=run)
    assert {t["status"] for t in list_tiers(src, root=run)} == {"incomplete"}
    stray = run / "int4-g128" / "layer-001.safetensors.tmp"
    stray.write_bytes(b"partial")
    log: list[QuantEvent] = []
    quantize_model(src, ["int4", "int2"], out=run, progress=events_into(log))
    assert [(e.precision.value, e.layer, e.status) for e in log] == [
        ("int4", 0, "skipped"), ("int2", 0, "skipped"), ("int4", 1, "written"), ("int2", 1, "written"),
    ]  # fmt: skip
    assert [e.done for e in log] == [1, 2, 3, 4] and not stray.exists()
    for name in ("int4-g128", "int2-g64"):
        assert files_of(run / name) == files_of(tmp_path / "ref" / name)
        open_quant_tier(src, name.split("-")[0], root=run).close()


def test_failure_inside_a_layer_leaves_no_partial_file(ckpt64: Callable[[str], Path], tmp_path, monkeypatch):
    src, calls = ckpt64("mixtral"), []
    experts = json.loads((src / "config.json").read_text())["num_local_experts"]
    real = quantize_mod.quantize_stack

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2 * experts + 2 * 2 + 1:  # layer 1, expert 2, its w13 (two fits per expert)
            raise RuntimeError("disk on fire")
        return real(*args, **kwargs)

    monkeypatch.setattr(quantize_mod, "BATCH_ELEMENTS", 1)  # one expert per batch
    monkeypatch.setattr(quantize_mod, "quantize_stack", flaky)
    with pytest.raises(RuntimeError, match="disk on fire"):
        quantize_model(src, ["int8"], out=tmp_path)
    path = tmp_path / "int8-gK"
    assert sorted(f.name for f in path.iterdir()) == ["layer-000.safetensors", "manifest.json"]
    assert [r["layer"] for r in json.loads((path / "manifest.json").read_text())["layers"]] == [0]


def test_tampered_layer_refused_by_open_and_redone_on_resume(ckpt64: Callable[[str], Path], tmp_path):
    src = ckpt64("gpt_oss")
    (path,) = quantize_model(src, ["int4"], out=tmp_path)
    good = files_of(path)
    layer1 = path / "layer-001.safetensors"
    data = bytearray(layer1.read_bytes())
    data[-100] ^= 0x10
    layer1.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"layer-001.safetensors: differs from the manifest"):
        open_quant_tier(src, "int4", root=tmp_path)
    (path / "layer-000.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"layer-000.safetensors: missing"):
        open_quant_tier(src, "int4", root=tmp_path)
    log: list[QuantEvent] = []
    quantize_model(src, ["int4"], out=tmp_path, progress=events_into(log))
    assert [(e.layer, e.status) for e in log] == [(0, "redone"), (1, "redone")]
    assert files_of(path) == good
    open_quant_tier(src, "int4", root=tmp_path).close()


def test_changed_source_refused_by_open_and_by_quantize(copy64: Callable[[str], Path], tmp_path):
    src = copy64("mixtral")
    quantize_model(src, ["int8"], out=tmp_path)
    file = src / "model.safetensors"
    sd = load_file(file)
    sd["model.layers.0.block_sparse_moe.experts.2.w1.weight"][0, 0] += 0.5
    save_file(sd, file, metadata={"format": "pt"})  # same header, same size: only the data changed
    with pytest.raises(CheckpointError, match=r"model.safetensors changed \(data differs\).*--force"):
        open_quant_tier(src, "int8", root=tmp_path)
    with pytest.raises(CheckpointError, match=r"another version of the model \(model.safetensors changed"):
        quantize_model(src, ["int8"], out=tmp_path)
    assert list_tiers(src, root=tmp_path)[0]["status"] == "stale"
    quantize_model(src, ["int8"], out=tmp_path, force=True)
    open_quant_tier(src, "int8", root=tmp_path).close()
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "use_cache": False}))
    with pytest.raises(CheckpointError, match=r"config\.json changed"):
        open_quant_tier(src, "int8", root=tmp_path)


def test_other_method_or_group_refused_unless_forced(ckpt64: Callable[[str], Path], tmp_path):
    src = ckpt64("qwen3_moe")
    quantize_model(src, ["int4"], out=tmp_path)
    with pytest.raises(CheckpointError, match=r"another method \('search', now 'rtn'\).*--force"):
        quantize_model(src, ["int4"], out=tmp_path, method="rtn")
    with pytest.raises(CheckpointError, match="another method"):  # checked before int8 writes anything
        quantize_model(src, ["int8", "int4"], out=tmp_path, method="rtn")
    assert not (tmp_path / "int8-gK").exists()
    (path,) = quantize_model(src, ["int4"], out=tmp_path, method="rtn", force=True)
    assert json.loads((path / "manifest.json").read_text())["method"] == "rtn"
    # an explicit default group is the same tier; another group is another directory
    assert quantize_model(src, ["int4"], out=tmp_path, group_sizes={"int4": 128}, method="rtn") == [path]
    assert quantize_model(src, ["int4"], out=tmp_path, group_sizes={"int4": 32})[0].name == "int4-g32"
    manifest = path / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"bits": 4', '"bits": "4"'))
    with pytest.raises(CheckpointError, match=r"malformed manifest \('bits' is '4'\)"):
        open_quant_tier(src, "int4", root=tmp_path)
    with pytest.raises(CheckpointError, match=r"malformed manifest.*--force"):
        quantize_model(src, ["int4"], out=tmp_path, method="rtn")
    quantize_model(src, ["int4"], out=tmp_path, method="rtn", force=True)
    open_quant_tier(src, "int4", root=tmp_path).close()


@pytest.mark.parametrize(
    ("family", "tensor", "where"),
    [
        ("qwen3_moe", "model.layers.1.mlp.experts.4.up_proj.weight", (2, 5)),
        ("gpt_oss", "model.layers.0.mlp.experts.down_proj", (3, 7, 1)),
    ],
)
def test_non_finite_source_expert_refused_naming_the_tensor(family, tensor, where, copy64, tmp_path):
    src = copy64(family)
    file = src / "model.safetensors"
    sd = load_file(file)
    sd[tensor][where] = float("nan") if family == "qwen3_moe" else float("inf")
    save_file(sd, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{tensor}'.*NaN/Inf"):
        quantize_model(src, ["int8"], out=tmp_path)


def test_missing_tier_names_the_command(ckpt64: Callable[[str], Path], tmp_path):
    src = ckpt64("qwen3_moe")
    with pytest.raises(CheckpointError, match=rf"run `moetier quantize {src} --precisions int4`"):
        open_quant_tier(src, "int4")
    with pytest.raises(CheckpointError, match=rf"--precisions int2 --group int2=32 --out {tmp_path}`"):
        open_quant_tier(src, "int2", group_size=32, root=tmp_path)


def test_bad_arguments_and_corrupt_source_refused(copy64: Callable[[str], Path], tmp_path):
    src = copy64("qwen3_moe")
    for precisions, groups, err in [
        (["int3"], None, "unknown precision 'int3'"),
        (["full"], None, "needs no quantized tier"),
        ([], None, "no precision"),
        (["int4"], {"int4": 48}, "multiple of 32"),
        (["int4"], {"int2": 64}, r"group size given for \['int2'\]"),
    ]:
        with pytest.raises(ConfigError, match=err):
            quantize_model(src, precisions, out=tmp_path, group_sizes=groups)
    with pytest.raises(ConfigError, match="unknown quantization method 'gptq'"):
        quantize_model(src, ["int4"], out=tmp_path, method="gptq")
    file = src / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="truncated"):
        quantize_model(src, ["int4"], out=tmp_path)


def test_read_into_casts_biases_checks_dest_and_is_thread_safe(ckpt64: Callable[[str], Path], tmp_path):
    src = ckpt64("gpt_oss")
    quantize_model(src, ["int2"], out=tmp_path)
    tier = open_quant_tier(src, "int2", root=tmp_path)
    keys = [ExpertKey(layer, e) for layer in tier.moe_layers for e in range(tier.num_experts)]
    want = {}
    for key in keys:
        want[key] = empty_like_specs(tier)
        tier.read_into(key, want[key])
    dest = {**empty_like_specs(tier), "b13": torch.empty(128).bfloat16(), "b2": torch.empty(32).bfloat16()}
    tier.read_into(keys[3], dest)
    assert torch.equal(dest["b13"], want[keys[3]]["b13"].bfloat16())
    assert torch.equal(dest["b2"], want[keys[3]]["b2"].bfloat16())
    assert torch.equal(dest["w2.q"], want[keys[3]]["w2.q"])
    with pytest.raises(ValueError, match=r"w13\.q"):
        tier.read_into(keys[0], {**empty_like_specs(tier), "w13.q": torch.empty(3, 3, dtype=torch.uint8)})
    with pytest.raises(KeyError):
        tier.read_into(ExpertKey(0, 99), dest)
    bad: list[ExpertKey] = []

    def worker(offset: int) -> None:
        mine = empty_like_specs(tier)
        for i in range(len(keys) * 3):
            key = keys[(i + offset) % len(keys)]
            tier.read_into(key, mine)
            if not all(torch.equal(mine[n], want[key][n]) for n in mine):
                bad.append(key)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad
    tier.close()


def test_rich_progress_bar_advances_over_precision_and_layer(ckpt64: Callable[[str], Path], tmp_path):
    src = ckpt64("qwen3_moe")
    with Progress(console=Console(file=StringIO(), width=400)) as progress:
        quantize_model(src, ["int8", "int4"], out=tmp_path, progress=progress)
        quantize_model(src, ["int8", "int4"], out=tmp_path, progress=progress)  # all skipped
    first, second = progress.tasks
    assert first.total == first.completed == 4 and second.completed == 4
    assert "skipped" in second.description
    assert "2 of 2 layers already written and verified, resuming" in progress.console.file.getvalue()


def test_short_reads_are_resumed(ckpt64: Callable[[str], Path], tmp_path, monkeypatch):
    src = ckpt64("gpt_oss")
    quantize_model(src, ["int4"], out=tmp_path)
    tier = open_quant_tier(src, "int4", root=tmp_path)
    want, got = empty_like_specs(tier), empty_like_specs(tier)
    tier.read_into(ExpertKey(1, 5), want)

    def trickle(fd: int, buffers: list[memoryview], offset: int) -> int:  # at most 7 bytes per call
        data = os.pread(fd, 7, offset)
        buffers[0][: min(len(data), len(buffers[0]))] = data[: len(buffers[0])]
        return min(len(data), len(buffers[0]))

    monkeypatch.setattr(os, "preadv", trickle)
    assert tier.read_into(ExpertKey(1, 5), got) == tier.expert_bytes
    assert all(torch.equal(got[n], want[n]) for n in want)
    tier.close()
