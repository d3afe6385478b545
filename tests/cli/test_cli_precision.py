"""The precision flags of the `moetier` command line: quantize, then eval and generate at a static or
dynamic precision, and the one-line errors for bad values.

The checkpoint is a tiny bf16 qwen3_moe with expert inner size 64 (int4/int2 need groups of 32+)
and test_cli's tokenizer; its tiers are written once per module by `moetier quantize`.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from test_cli import _save_tokenizer, assert_user_error, invoke, last_json

from moetier.models.tiny import build_tiny_checkpoint

EXPERTS = 12  # 2 MoE layers x 6


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = build_tiny_checkpoint(
        "qwen3_moe", tmp_path_factory.mktemp("tiny64") / "qwen3_moe", dtype=torch.bfloat16, moe_intermediate_size=64
    )
    _save_tokenizer(folder)
    return folder



@pytest.fixture(scope="module")
def quantized(tiny64: Path) -> dict[str, Any]:
    """`moetier quantize MODEL --precisions int8,int4 --json`, run once; its JSON."""
    return last_json(invoke("quantize", tiny64, "--precisions", "int8,int4", "--json"))


def tier_files(model: Path, name: str, stamp: bool = False) -> dict[str, int]:
    """layer file name -> mtime; `stamp` first sets every mtime to 1 s after the epoch, so that a file
    kept is told from a file written again."""
    files = sorted((model / "moetier-quant" / name).glob("layer-*"))
    for f in files if stamp else ():
        os.utime(f, ns=(10**9, 10**9))
    return {f.name: f.stat().st_mtime_ns for f in files}


def test_quantize_writes_tiers_and_reports_them(tiny64: Path, quantized: dict[str, Any]) -> None:
    tiers = {t["precision"]: t for t in quantized["tiers"]}
    assert set(tiers) == {"int8", "int4"}
    for prec, name in (("int8", "int8-gK"), ("int4", "int4-g128")):
        t = tiers[prec]
        assert t["path"] == str(tiny64 / "moetier-quant" / name)
        assert t["complete"] and t["layers_done"] == t["layers_total"] == 2 and t["bytes"] > 0
        assert 0 < t["error"]["w13"] < 0.5 and 0 < t["error"]["w2"] < 0.5
    assert tiers["int8"]["error"]["w13"] < tiers["int4"]["error"]["w13"]
    assert tiers["int8"]["bytes"] > tiers["int4"]["bytes"]


def test_quantize_resumes_and_force_rewrites(tiny64: Path, quantized: dict[str, Any]) -> None:
    before = tier_files(tiny64, "int4-g128", stamp=True)
    again = invoke("quantize", tiny64, "--precisions", "int8,int4")
    assert again.exit_code == 0, (again.stderr, again.exception)
    said = " ".join(again.stderr.split())  # rich wraps at the terminal width
    assert said.count("2 of 2 layers already written and verified, resuming") == 2
    assert "int4 layer 1: skipped" in said and "quantized tiers" in again.stdout
    assert tier_files(tiny64, "int4-g128") == before  # nothing rewritten
    refused = invoke("quantize", tiny64, "--precisions", "int4", "--method", "rtn")
    assert_user_error(refused, "error:", "another method ('search', now 'rtn')", "--force")
    forced = invoke("quantize", tiny64, "--precisions", "int4", "--force")
    assert forced.exit_code == 0, (forced.stderr, forced.exception)
    assert "resuming" not in forced.stderr
    after = tier_files(tiny64, "int4-g128")
    assert sorted(after) == ["layer-000.safetensors", "layer-001.safetensors"] == sorted(before)
    assert all(after[f] > before[f] for f in after)  # deleted and written again


def test_eval_static_int4_json(tiny64: Path, quantized: dict[str, Any], text_file: Path) -> None:
    full = last_json(invoke("eval", tiny64, "--text", text_file, "--max-tokens", 40, "--json"))
    data = last_json(invoke("eval", tiny64, "--text", text_file, "--max-tokens", 40, "--precision", "int4", "--json"))
    assert data["tokens"] == full["tokens"] == 39
    assert math.isfinite(data["ppl"]) and data["ppl"] != full["ppl"]
    assert abs(math.log(data["ppl"]) - math.log(full["ppl"])) < 0.5  # nats per token
    ((prec, mix),) = data["precision"].items()
    assert prec == "int4" and 0 < mix["experts"] <= EXPERTS
    assert mix["bytes"] * full["precision"]["full"]["experts"] < full["precision"]["full"]["bytes"] * mix["experts"]
    assert data["promotions"] == data["demotions"] == 0 and "switching" not in data
    human = invoke("eval", tiny64, "--text", text_file, "--max-tokens", 12, "--precision", "int8")
    assert human.exit_code == 0, (human.stderr, human.exception)
    assert "experts at int8" in human.stdout and "promotions" not in human.stdout


def _dynamic_budget(model: Path) -> int:
    """A budget with room for 5 int4 experts, the others at int2."""
    import moetier
    from moetier import Budgets, EngineConfig, RuntimeConfig
    from moetier.config import PrecisionConfig

    cfg = EngineConfig(budgets=Budgets(host_expert_bytes=10**9), runtime=RuntimeConfig(device="cpu"),
                       precision=PrecisionConfig(mode="dynamic", hi="int4", lo="int2"))  # fmt: skip
    with moetier.load(model, cfg) as probe:
        store = probe.store
        hi, lo = (store.pools[p].pool.slot_bytes for p in (store.hi_precision, store.lo_precision))
        return (EXPERTS + 1) * lo + store.staging_bytes + 5 * (hi - lo)


def test_generate_dynamic_json(tiny64: Path, quantized: dict[str, Any], text_file: Path) -> None:
    args = ("generate", tiny64, "--prompt", "ROMEO:", "--max-new-tokens", 5, "--ignore-eos", "--device", "cpu",
            "--precision", "dynamic", "--hi", "int4", "--lo", "int2")  # fmt: skip
    assert_user_error(invoke(*args, "--host-expert-mem", "1GiB"), "error:", "no int2 quantized tier",
                      f"moetier quantize {tiny64} --precisions int2`")  # fmt: skip
    assert invoke("quantize", tiny64, "--precisions", "int2").exit_code == 0
    budget = _dynamic_budget(tiny64)
    result = invoke(*args, "--host-expert-mem", budget, "--warmup", text_file, "--warmup-tokens", 64, "--json")
    data = last_json(result)
    assert data["new_tokens"] == 5 == len(data["token_ids"])
    assert set(data["precision"]) == {"int4", "int2"}
    assert data["precision"]["int4"]["experts"] == 5
    assert sum(m["experts"] for m in data["precision"].values()) == EXPERTS
    assert data["tiers"]["host"]["budget_bytes"] == budget
    assert data["peak_host_expert_bytes"] + data["staging_bytes"] <= budget
    sw = data["switching"]
    assert sw["n_hot"] == 5 and sw["decisions"] == 1 and sw["mover_errors"] == [] and sw["pending_moves"] == 0
    assert data["promotions"] == data["demotions"] > 0  # the warmup moved the hot set
    # the warmup line names its promotions; no decision ran after it (period 128 > tokens fed)
    assert f"warmup: 64 tokens, {data['promotions']} experts promoted" in result.stderr
    human = invoke(*args, "--host-expert-mem", budget, "--period", 2, "--sync-switches")
    assert human.exit_code == 0, (human.stderr, human.exception)
    for needle in ("experts at int4", "experts at int2", "promotions / demotions", "precision decisions"):
        assert needle in human.stdout, needle


def test_eval_dynamic_sync_is_reproducible(tiny64: Path, quantized: dict[str, Any], text_file: Path) -> None:
    if not (tiny64 / "moetier-quant" / "int2-g64").exists():
        assert invoke("quantize", tiny64, "--precisions", "int2").exit_code == 0
    args = ("eval", tiny64, "--text", text_file, "--max-tokens", 48, "--window", 8, "--precision", "dynamic",
            "--hi", "int4", "--lo", "int2", "--host-expert-mem", _dynamic_budget(tiny64), "--period", 4,
            "--sync-switches", "--json")  # fmt: skip
    a, b = last_json(invoke(*args)), last_json(invoke(*args))
    assert a["switching"]["decisions"] > 1
    assert (a["ppl"], a["promotions"], a["precision"]) == (b["ppl"], b["promotions"], b["precision"])


def test_controller_transient_buffer_and_dram_cache_flags(tiny64: Path, quantized: dict[str, Any],
                                                          text_file: Path) -> None:  # fmt: skip
    """--hysteresis, --ema-alpha, --period, --lookahead reach the controller; --transient-slots the pools
    (counted in the budget); --host-cache-mem and --precision-prefetch the DRAM level, whose hit rates
    --json carries."""
    if not (tiny64 / "moetier-quant" / "int2-g64").exists():
        assert invoke("quantize", tiny64, "--precisions", "int2").exit_code == 0
    base = ("eval", tiny64, "--text", text_file, "--max-tokens", 64, "--window", 6, "--precision", "dynamic",
            "--hi", "int4", "--lo", "int2", "--sync-switches", "--json")  # fmt: skip
    budget = _dynamic_budget(tiny64)
    flags = ("--hysteresis", 0, "--ema-alpha", 0.9, "--period", 8, "--lookahead", 1, "--precision-prefetch",
             "--host-cache-mem", "4MiB")  # fmt: skip
    # a transient slot needs its bytes: at the 5-hot budget it costs hot slots
    plain = last_json(invoke(*base, "--host-expert-mem", budget, *flags))
    two = last_json(invoke(*base, "--host-expert-mem", budget, *flags, "--transient-slots", 1))
    sw, sw2 = plain["switching"], two["switching"]
    assert (sw["hysteresis"], sw["alpha"], sw["period"], sw["lookahead"]) == (0.0, 0.9, 8, 1.0)
    assert sw["n_hot"] == 5 and sw["workers"] == 1 and sw["transient"]["hi_slots"] == 0
    assert sw2["n_hot"] < 5 and sw2["workers"] == 2 and sw2["transient"]["hi_slots"] == 1
    assert two["tiers"]["host"]["pool_bytes"] + two["staging_bytes"] <= budget
    dram = sw["dram"]
    assert dram["budget_bytes"] == 4 * 2**20 and set(dram["precisions"]) == {"int4", "int2"}
    looks = sum(p["hits"] + p["misses"] for p in dram["precisions"].values())
    assert looks == EXPERTS + plain["promotions"] + plain["demotions"] and 0 <= dram["hit_rate"] <= 1
    assert sw["decisions"] > 2 and "prefetch" in sw and sw["prefetch"]["errors"] == []
    # a reproducible run: the same flags give the same figures
    again = last_json(invoke(*base, "--host-expert-mem", budget, *flags))
    assert (again["ppl"], again["switching"]["dram"], again["promotions"]) == (plain["ppl"], dram, plain["promotions"])
    # the human-readable stats table shows the DRAM level's hit rates
    text = invoke(*base[:-1], "--host-expert-mem", budget, *flags)
    assert text.exit_code == 0 and "host DRAM cache hits" in text.output


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (("--precision", "dynamic", "--hi", "int8", "--lo", "int4", "--host-expert-mem", "1GiB", "--ema-alpha", "1"),
         ("alpha must be in (0, 1)",)),
        (("--precision", "int4", "--host-cache-mem", "1MiB"), ("need --precision dynamic",)),
        (("--precision", "dynamic", "--hi", "int8", "--lo", "int4", "--host-expert-mem", "1GiB",
          "--precision-prefetch"), ("set --host-cache-mem",)),
        (("--precision", "dynamic", "--hi", "int8", "--lo", "int4", "--host-expert-mem", "1GiB",
          "--host-cache-mem", "1KiB"), ("--host-cache-mem", "cannot hold one expert")),
        (("--precision", "int3"), ("precision must be one of", "'int3'")),
        (("--precision", "int4", "--group", "int4=48"), ("int4 group size must be 32, 64, 128 or 256, got 48",)),
        (("--precision", "int4", "--group", "int4"), ("--group takes PREC=SIZE", "'int4'")),
        (("--precision", "int4", "--group", "full=64"), ("only int8, int4 and int2 have groups",)),
        (("--precision", "int4", "--group", "int4=32"), ("no int4 quantized tier", "--group int4=32`")),
        (("--precision", "dynamic", "--hi", "int4", "--lo", "int8"), ("hi above lo",)),
        (("--precision", "dynamic", "--hi", "int5"), ("--hi precision must be one of",)),
        (("--precision", "dynamic", "--hi", "int8", "--lo", "int4"), ("--host-expert-mem", "between")),
        (("--precision", "dynamic", "--hi", "int8", "--lo", "int4", "--host-expert-mem", "1KiB"),
         ("minimum budget is",)),
        (("--precision", "int4", "--warmup", "WARMUP"), ("--warmup needs --precision dynamic",)),
    ],
)  # fmt: skip
def test_bad_precision_flags_exit_2_with_one_line(
    tiny64: Path, quantized: dict[str, Any], text_file: Path, flags: tuple[str, ...], needles: tuple[str, ...]
) -> None:
    flags = tuple(str(text_file) if f == "WARMUP" else f for f in flags)
    for command in (("generate", tiny64, "--prompt", "ROMEO:", "--max-new-tokens", 2),
                    ("eval", tiny64, "--text", text_file)):  # fmt: skip
        result = invoke(*command, *flags)
        assert_user_error(result, "error:", *needles)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        assert result.stdout == ""


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (("--precisions", "int3"), "unknown precision 'int3'"),
        (("--precisions", "full"), "needs no quantized tier"),
        (("--precisions", ","), "no precision"),
        (("--precisions", "int4", "--group", "int4=48"), "multiple of 32"),
        (("--precisions", "int4", "--group", "int2=64"), "group size given for ['int2']"),
        (("--precisions", "int4", "--method", "gptq"), "unknown quantization method 'gptq'"),
    ],
)
def test_bad_quantize_flags_exit_2(tiny64: Path, flags: tuple[str, ...], needle: str, tmp_path: Path) -> None:
    result = invoke("quantize", tiny64, *flags, "--out", tmp_path)
    assert_user_error(result, "error:", needle)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert list(tmp_path.iterdir()) == []  # refused before writing anything


def test_quantize_out_and_group_then_eval(tiny64: Path, text_file: Path, tmp_path: Path) -> None:
    data = last_json(invoke("quantize", tiny64, "--precisions", "int2", "--group", "int2=32", "--out", tmp_path,
                            "--json"))  # fmt: skip
    (tier,) = data["tiers"]
    assert tier["path"] == str(tmp_path / "int2-g32") and tier["group_sizes"] == {"w13": 32, "w2": 32}
    meta = json.loads((tmp_path / "int2-g32" / "manifest.json").read_text())
    assert meta["complete"] and meta["group"] == "32"
    data = last_json(invoke("eval", tiny64, "--text", text_file, "--max-tokens", 10, "--precision", "int2",
                            "--group", "int2=32", "--quant-dir", tmp_path, "--json"))  # fmt: skip
    assert set(data["precision"]) == {"int2"} and math.isfinite(data["ppl"])
