"""The MFU helpers of ``benchmarks/common.py``: FLOP counts against hand counts, the analytic LM count against
torch's FlopCounterMode on a tiny Qwen3 (meta device), and a benchmark table carrying the MFU column."""

import math
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))

import common  # noqa: E402

torch.set_num_threads(1)


def test_linear_forward_and_backward_by_hand():
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8, bias=False)
    x = torch.randn(4, 16, requires_grad=True)
    fwd = 2 * 4 * 16 * 8
    assert common.count_flops(lin, x) == fwd
    # trained weight: input gradient + weight gradient
    assert common.count_flops(lambda: lin(x).sum().backward()) == 3 * fwd
    # frozen weight (LoRA's base): the input gradient only
    lin.weight.requires_grad_(False)
    assert common.count_flops(lambda: lin(x).sum().backward()) == 2 * fwd


def test_mlp_on_meta_counts_as_on_cpu():
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    x = torch.randn(5, 32)
    on_cpu = common.count_flops(lambda: mlp(x).sum().backward())
    meta = mlp.to("meta")
    on_meta = common.count_flops(lambda: meta(x.to("meta")).sum().backward())
    # the first layer's input needs no gradient: its forward + weight gradient (2x); the second layer 3x
    hand = 2 * 5 * (32 * 64 * 2 + 64 * 32 * 3)
    assert on_cpu == on_meta == hand


def _tiny_qwen3(device: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        return Qwen3ForCausalLM(cfg), cfg


@pytest.mark.parametrize("backward", [None, "full", "lora"])
def test_lm_replay_flops_match_flop_counter_on_meta(backward):
    """FlopCounterMode counts attention as the full T x T square (causal or not): the analytic count's attention
    term is half of it, everything else agrees exactly (with the head on every position here)."""
    model, cfg = _tiny_qwen3("meta")
    if backward == "lora":
        for name, p in model.named_parameters():
            p.requires_grad_(False)
    rows, t = 3, 20
    ids = torch.zeros(rows, t, dtype=torch.long, device="meta")

    def run():
        if backward is None:
            with torch.no_grad():
                model(ids)
            return
        emb = model.get_input_embeddings()(ids)
        if backward == "lora":
            emb.requires_grad_(True)  # a LoRA adapter in the first layer makes the activations need gradients
        model(inputs_embeds=emb).logits.sum().backward()

    counted = common.count_flops(run)
    # the analytic count puts the head on response positions only: all t positions here (prompt_len 0)
    analytic = common.lm_replay_flops(cfg, rows, 0, t, backward=backward)
    d = common.lm_dims(cfg)
    square_attention = rows * 4 * d["layers"] * d["q"] * t * t * {None: 1, "full": 3, "lora": 3}[backward]
    causal_attention = square_attention * (t / 2) / t
    assert counted - square_attention == pytest.approx(analytic - causal_attention, rel=1e-12)


def test_lm_generate_flops_by_hand():
    cfg = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, head_dim=4, vocab_size=10)
    body = 2 * (8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 16)
    head, attn = 2 * 8 * 10, lambda ctx: 4 * 8 * ctx
    want = 2 * (5 * (body + attn(2.5)) + 3 * (body + head + attn(5 + 1.5)))
    assert common.lm_generate_flops(cfg, 2, 5, 3) == want


def test_grpo_recipe_flops_are_generation_plus_full_replay():
    import argparse

    import grpo_shapes

    a = argparse.Namespace(shape="qwen3-0.6b", prompts=2, group=4, prompt_len=16, new_tokens=32)
    c = grpo_shapes.SHAPES["qwen3-0.6b"]
    replay = common.lm_replay_flops(c, 8, 16, 32, backward=None)
    want = common.lm_generate_flops(c, 8, 16, 32) + 3 * replay
    assert grpo_shapes.model_flops_per_step(a) == pytest.approx(want)


def test_mfu_and_its_cell():
    assert common.mfu(2e12, 0.5, 8.0) == pytest.approx(0.5)
    assert math.isnan(common.mfu(2e12, 0.5, None))  # CPU: no peak
    fields = common.mfu_fields(1e12, 1.0, None)
    assert fields["model_flops_per_step"] == 1e12 and fields["peak_tflops"] is None and math.isnan(fields["mfu"])
    assert common.fmt_mfu(float("nan")) == "-" and common.fmt_mfu(None) == "-"
    assert common.fmt_mfu(0.4213) == "42.1%"
    with pytest.raises(ValueError, match="backward="):
        common.lm_replay_flops({"hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
                                "num_attention_heads": 1, "vocab_size": 4}, 1, 1, 1, backward="half")


def test_ar_rollout_table_has_mfu_column():
    from benchmarks import bench_ar_rollout

    row = {"method": "hf_generate", "tokens": 64, "median_s": 0.5, "tok_per_s": 128.0, "ratio_vs_hf_generate": 1.0}
    gpu = dict(row, **common.mfu_fields(2e12, 0.5, 8.0))
    cpu = dict(row, **common.mfu_fields(2e12, 0.5, None))
    header, gpu_line, cpu_line = (line.split("|") for line in
                                  [bench_ar_rollout.md_table([gpu])[0], *bench_ar_rollout.md_table([gpu, cpu])[2:]])
    col = [h.strip() for h in header].index("MFU")
    assert gpu_line[col].strip() == "50.0%" and cpu_line[col].strip() == "-"


def test_without_recompute_drops_checkpointing_from_the_count():
    model, _ = _tiny_qwen3("cpu")  # torch.utils.checkpoint does not run on meta tensors
    model.train()
    ids = torch.zeros(2, 12, dtype=torch.long)
    step = lambda: model(ids).logits.sum().backward()  # noqa: E731
    plain = common.count_flops(step)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    recomputed = common.count_flops(step)
    with common.without_recompute(model):
        assert common.count_flops(step) == plain
    assert recomputed > plain  # the decoder layers' forwards run twice
    assert common.count_flops(step) == recomputed  # back on after


def test_step_model_flops_compose_the_rows_of_a_flow_grpo_step():
    """The recipe step's count scales with CFG rows, adds one reference forward per trained step with a KL, and is
    None for the tiny presets (no MFU on CPU recipes)."""
    import bench_step_cost
    import step_cost_shapes

    from unirl_core.config import load_recipe

    p = bench_step_cost.PRESETS["sd35m-lora"]
    spec = {"preset": "sd35m-lora", "shaped": "sd35m", "device": "cpu", "layers": 1}
    base = [*p["overrides"], "diffusion.model.device=cpu", "diffusion.sampling.height=64",
            "diffusion.sampling.width=64"]
    cfg = lambda *extra: load_recipe(p["recipe"], [*base, *extra])  # noqa: E731
    fwd, train = step_cost_shapes._sd35m_row_flops(spec, cfg())
    assert fwd < train < 3 * fwd  # LoRA: the frozen base's backward is about one forward
    with_kl = step_cost_shapes.step_model_flops(spec, cfg())
    no_kl = step_cost_shapes.step_model_flops(spec, cfg("diffusion.algorithm.kl_beta=0.0"))
    no_cfg = step_cost_shapes.step_model_flops(spec, cfg("diffusion.algorithm.kl_beta=0.0",
                                                         "diffusion.sampling.guidance_scale=1.0"))
    rows, steps = 2 * 16, 10  # 2 prompts x 16 samples, 10 steps, timestep_fraction 0.99 -> all 10 trained
    assert with_kl - no_kl == rows * 2 * steps * fwd
    assert no_kl == 2 * no_cfg == rows * 2 * steps * (fwd + train)
    tiny = bench_step_cost.PRESETS["tiny-grpo"]
    assert step_cost_shapes.step_model_flops({"shaped": None}, load_recipe(tiny["recipe"], [])) is None
