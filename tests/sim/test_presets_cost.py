"""Model shapes, GPU budgets and the step cost model against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest

from asyncpaged.sim.cost_model import CostModel
from asyncpaged.sim.presets import GPUS, MODELS, ModelShape, kv_cache_bytes, num_kv_blocks


def test_kv_bytes_per_token_match_the_paper() -> None:
    assert MODELS["opt-13b"].kv_bytes_per_token == 2 * 5120 * 40 * 2  # 800 KiB
    assert MODELS["llama-13b"].kv_bytes_per_token == 2 * 5120 * 40 * 2
    assert MODELS["opt-66b"].kv_bytes_per_token == 2 * 9216 * 64 * 2
    assert MODELS["opt-175b"].kv_bytes_per_token == 2 * 12288 * 96 * 2


@pytest.mark.parametrize(
    ("name", "published"),
    [("opt-13b", 12.85e9), ("opt-66b", 65.7e9), ("opt-175b", 174.6e9), ("llama-13b", 13.0e9)],
)
def test_parameter_counts_are_within_one_percent_of_the_published(
    name: str, published: float
) -> None:
    assert MODELS[name].num_params == pytest.approx(published, rel=0.01)


def test_hf_config_gives_the_preset(tmp_path: object) -> None:
    opt = {
        "model_type": "opt",
        "num_hidden_layers": 40,
        "hidden_size": 5120,
        "num_attention_heads": 40,
        "ffn_dim": 20480,
        "vocab_size": 50272,
        "max_position_embeddings": 2048,
    }
    shape = ModelShape.from_hf_config(opt)
    assert shape.kv_bytes_per_token == 819200
    assert shape.num_params == MODELS["opt-13b"].num_params
    gqa = {
        "model_type": "llama",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
    }
    assert ModelShape.from_hf_config(gqa).kv_bytes_per_token == 2 * 32 * 8 * 128 * 2


def test_opt_13b_on_a100_40gb_leaves_about_12_gb_for_kv() -> None:
    model, gpu = MODELS["opt-13b"], GPUS["a100-40gb"]
    left = 0.9 * 40 * 2**30 - 2 * 12_840_304_640
    assert kv_cache_bytes(model, gpu) == pytest.approx(left, abs=1)
    assert num_kv_blocks(model, gpu) == math.floor(left / (819200 * 16)) == 989
    with pytest.raises(ValueError, match="use more GPUs"):
        kv_cache_bytes(MODELS["opt-175b"], gpu)
    assert num_kv_blocks(MODELS["opt-175b"], GPUS["a100-80gb"], num_gpus=8) > 0


def test_decode_step_is_weights_plus_kv_reads() -> None:
    model, gpu = MODELS["opt-13b"], GPUS["a100-40gb"]
    cost = CostModel(model=model, gpu=gpu, paged_overhead=0.25, step_overhead_s=0.0)
    bandwidth = 1555e9 * 0.8
    weights_s = 2 * 12_840_304_640 / bandwidth
    kv_s = 819200 * (999 + 2) / bandwidth  # reads 1000 tokens of context, writes one
    contiguous = cost.step_time_s([(999, 1)], 1, paged=False)
    assert contiguous == pytest.approx(weights_s + kv_s, rel=1e-9)
    assert cost.step_time_s([(999, 1)], 1) == pytest.approx(weights_s + 1.25 * kv_s, rel=1e-9)


def test_prefill_is_compute_bound_and_steps_grow_with_work() -> None:
    model, gpu = MODELS["opt-13b"], GPUS["a100-40gb"]
    cost = CostModel(model=model, gpu=gpu, step_overhead_s=0.0)
    dense = 12_840_304_640 - 50272 * 5120
    flops = 2 * dense * 2048 + 2 * 50272 * 5120
    attention = 4 * 40 * 5120 * (2048 * 2049 // 2)
    expected = flops / (312e12 * 0.6) + 1.2 * attention / (312e12 * 0.6)
    assert cost.step_time_s([(0, 2048)], 1) == pytest.approx(expected, rel=1e-9)
    one = cost.step_time_s([(100, 1)] * 8, 8)
    assert one < cost.step_time_s([(100, 1)] * 9, 9) < cost.step_time_s([(500, 1)] * 9, 9)


def test_swap_time_is_bytes_over_the_host_link() -> None:
    cost = CostModel(model=MODELS["opt-13b"], gpu=GPUS["a100-40gb"])
    assert cost.swap_time_s(10, 16) == pytest.approx(10 * 16 * 819200 / 25e9)
