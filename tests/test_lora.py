"""LoRA (config.model.lora, angel_jax/lora.py): the base weights stay bit for bit as they
started and only the adapters train; the optimizer state and the plan count the adapters
alone; a merged model computes the adapted one's logits; a resumed run continues the loss
curve; the export writes W + alpha / rank * A B; bad settings are refused in one line.

Tolerances: float32 compute. Merging changes the order of the sums ((W + s A B) x against
W x + s (x A) B): logits within 1e-5 of the largest; the exported weights within 1e-6 of
numpy's merge."""

import shutil

import jax
import ml_collections
import numpy as np
import pytest

from angel_jax import lora, models
from angel_jax.config import ConfigError, load_config
from angel_jax.interop import hf
from angel_jax.loop import train_loop
from angel_jax.mesh import make_mesh
from angel_jax.planning.plan import local_bytes
from angel_jax.train import build
from tests.runs import ROOT, losses
from tests.test_export import SMALL, TOKENS, VOCAB, imported, logits, restored, run_export

ARGS = [
    *SMALL,
    "--config.data.synthetic=true",
    "--config.train.log_every_steps=1",
    "--config.checkpoint.async_save=false",
    "--config.offload.device_gib=1",
]
ALL = "q,k,v,o,gate,up,down"
LORA = [
    "--config.model.lora.rank=4",
    "--config.model.lora.alpha=8",
    f"--config.model.lora.targets={ALL}",
]
SPLIT = ["--config.mesh.data=4", "--config.mesh.tensor=2"]
# name -> (config file, overrides): Mixtral's experts take no adapters, its attention does.
RUNS = {
    "llama": ("configs/tiny.py", [*ARGS, *LORA]),
    "mixtral": (
        "configs/mixtral_tiny.py",
        [*ARGS, *LORA, "--config.model.lora.targets=q,k,v,o"]
        + ["--config.model.num_experts=4", "--config.model.moe_ffn_dim=48"],
    ),
}


def experiment(name: str, *overrides: str):
    path, args = RUNS[name]
    config = load_config(str(ROOT / path), [*args, *overrides])
    return build(config, make_mesh(config.mesh), fit_compiled=False)


def batches(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, (8, 17)).astype(np.int32) for _ in range(n)]


def paths(tree) -> dict:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_base_weights_stay_bitwise_and_only_the_adapters_train(name):
    exp = experiment(name, *SPLIT, "--config.zero_stage=3")
    state = exp.init_state()
    start = paths(jax.device_get(state.params))
    for rows in batches(3):
        state, _ = exp.train_step(state, exp.global_batch(rows))
    end = paths(jax.device_get(state.params))
    adapted = [p for p in start if p.endswith(("['lora_a']", "['lora_b']"))]
    assert len(adapted) == 2 * (7 if name == "llama" else 4)
    for path, before in start.items():
        if path in adapted:
            assert not np.array_equal(end[path], before), path
        else:
            np.testing.assert_array_equal(end[path], before, err_msg=path)
    assert not np.any(start[adapted[1]]), "B starts at zero: the base model's output"


def test_adapters_are_split_like_their_kernels():
    """A's input dims as the kernel's, B's output dims as the kernel's, the rank whole."""
    exp = experiment("llama", *SPLIT, "--config.zero_stage=0")
    layers = jax.tree.map(lambda s: tuple(s.spec), exp.state_sharding.params["layers"])
    n_ins = {"query": 1, "key": 1, "value": 1, "out": 2, "gate": 1, "up": 1, "down": 1}
    for block in ("attn", "mlp"):
        for name, specs in layers[block].items():
            if name not in n_ins:
                continue
            kernel, split = specs["kernel"], 1 + n_ins[name]  # After the "layers" dim.
            assert specs["lora_a"] == (*kernel[:split], None), name
            assert specs["lora_b"] == (kernel[0], None, *kernel[split:]), name
    assert layers["attn"]["query"]["lora_b"][2] == "tensor"  # Heads, as the kernel's.
    assert layers["attn"]["out"]["lora_a"][1] == "tensor"
    assert layers["mlp"]["down"]["lora_a"][1] == "tensor"  # The MLP's hidden dim.


def test_optimizer_state_and_the_plan_count_the_adapters_alone():
    exp = experiment("llama", "--config.zero_stage=0")
    full = experiment("llama", "--config.zero_stage=0", "--config.model.lora.rank=0")
    adapters = lora.adapters(exp.abstract_state.params)
    n = sum(x.size for x in jax.tree.leaves(adapters))
    opt = exp.abstract_state.opt_state
    # The state is a tree over the adapters, each leaf AdamW's: mu and nu, float32.
    jax.tree.structure(adapters).flatten_up_to(opt)
    moments = [x for x in jax.tree.leaves(opt) if x.dtype == np.float32]
    assert sum(x.size for x in moments) == 2 * n
    # The planner counts what the state holds, and grads for the adapters only.
    assert exp.plan.state_bytes["optimizer state"] == local_bytes(opt)
    assert exp.plan.state_bytes["grads"] == 4 * n  # Replicated (ZeRO-0, data only).
    counts = local_bytes(opt) - 8 * n  # Adam's and the schedule's step counts.
    assert counts == 2 * 4 * exp.config.model.num_layers * len(jax.tree.leaves(adapters))
    everything = sum(x.size for x in jax.tree.leaves(full.abstract_state.params))
    assert full.plan.state_bytes["grads"] == 4 * everything
    assert exp.plan.state_bytes["compute params"] == 4 * (everything + n)
    assert exp.plan.state_bytes["optimizer state"] < full.plan.state_bytes["optimizer state"] / 10


def test_mfu_counts_no_weight_grads_for_the_frozen_base():
    exp = experiment("llama", "--config.zero_stage=0")
    cfg, params, t = exp.model_config, exp.abstract_state.params, 16
    n = sum(x.size for x in jax.tree.leaves(lora.adapters(params)))
    # Per token: the frozen matmuls forward and for their inputs' grads, the adapters all three.
    attention = cfg.flops_per_token(t) - 6 * cfg.matmul_params()
    want = 4 * cfg.matmul_params() + 6 * n + attention
    assert lora.flops_per_token(cfg, params, t) == pytest.approx(want)
    full = experiment("llama", "--config.zero_stage=0", "--config.model.lora.rank=0")
    same = full.model_config.flops_per_token(t)
    assert lora.flops_per_token(full.model_config, full.abstract_state.params, t) == same


def test_merged_model_computes_the_adapted_logits():
    exp = experiment("llama", *SPLIT)
    base = experiment("llama", *SPLIT, "--config.model.lora.rank=0")
    params = jax.device_get(exp.init_state().params)
    # Adapters far from their start (B = 0 would merge to the base model).
    rng = np.random.default_rng(2)
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: (
            rng.normal(0, 0.05, x.shape).astype(x.dtype)
            if jax.tree_util.keystr(p).endswith("['lora_b']")
            else x
        ),
        params,
    )
    adapted = logits(exp, params, TOKENS)
    merged = logits(base, lora.merged(params, exp.model_config.lora.scale), TOKENS)
    scale = np.abs(adapted).max()
    assert np.abs(merged - adapted).max() <= 1e-5 * scale
    assert np.abs(logits(base, lora.base(params), TOKENS) - adapted).max() > 1e-2 * scale


def train(workdir, *overrides: str):
    path, args = RUNS["llama"]
    train_loop(load_config(str(ROOT / path), [*args, *overrides]), str(workdir))


def test_resume_with_adapters_continues_the_uninterrupted_loss_curve(tmp_path):
    """With dropout: its keys follow the step, so a resumed step draws the same masks."""
    steps = ["--config.train.steps=4", "--config.model.lora.dropout=0.1", *SPLIT]
    train(tmp_path / "reference", *steps)
    expected = losses(tmp_path / "reference")
    assert sorted(expected) == [1, 2, 3, 4]
    resumed = tmp_path / "resumed"  # Interrupted after its checkpoint of step 2.
    shutil.copytree(tmp_path / "reference" / "checkpoints" / "2", resumed / "checkpoints" / "2")
    train(resumed, *steps)
    got = losses(resumed)
    assert sorted(got) == [3, 4]
    assert [got[s] for s in (3, 4)] == [expected[s] for s in (3, 4)]


def test_export_writes_merged_weights_that_import_back_with_the_adapted_logits(tmp_path, capsys):
    targets = "--config.model.lora.targets=q,v,down"
    argv = ["--config", str(ROOT / RUNS["llama"][0]), *RUNS["llama"][1], targets]
    train_loop(load_config(argv[1], argv[2:]), str(tmp_path / "run"))
    out = tmp_path / "hf"
    assert run_export(argv, tmp_path / "run", out) == 0
    exp, params = restored(argv, tmp_path / "run")
    layers = jax.tree.map(np.asarray, jax.device_get(params["layers"]))
    attn, mlp = layers["attn"], layers["mlp"]

    def merge(w, i):  # W + alpha / rank * A B of layer i, as (in, out): one input dim here.
        a = w["lora_a"][i]
        return w["kernel"][i].reshape(a.shape[0], -1) + 8 / 4 * a @ w["lora_b"][i].reshape(4, -1)

    checkpoint = hf.Checkpoint(out)
    for i in range(exp.config.model.num_layers):
        read = lambda name, i=i: checkpoint.read(f"model.layers.{i}.{name}.weight")
        # Hugging Face's (out, in) layout: ours transposed, the heads flattened.
        np.testing.assert_allclose(read("self_attn.q_proj"), merge(attn["query"], i).T, 1e-6, 1e-7)
        np.testing.assert_allclose(read("mlp.down_proj"), merge(mlp["down"], i).T, 1e-6, 1e-7)
        key = np.reshape(attn["key"]["kernel"][i], (64, -1))  # Not targeted: as it was.
        np.testing.assert_array_equal(read("self_attn.k_proj"), key.T)
        assert np.any(attn["query"]["lora_b"][i])  # Trained: the merge is no no-op.
    assert not any("lora" in name for name in checkpoint.names())

    # Imported with fresh adapters (B = 0): the merged model's logits, the adapted run's.
    back_exp, back = imported(argv, out)
    np.testing.assert_array_equal(np.asarray(back["layers"]["attn"]["query"]["lora_b"]), 0)
    adapted = logits(exp, params, TOKENS)
    again = logits(back_exp, back, TOKENS)
    assert np.abs(again - adapted).max() <= 1e-5 * np.abs(adapted).max()

    # Exported with other LoRA settings than the run's: named with the fix.
    other = [*argv, "--config.model.lora.rank=8", "--overwrite"]
    assert run_export(other, tmp_path / "run", out) == 2
    assert "pass --config.model.lora.rank=4" in capsys.readouterr().err


def refusal(overrides: dict, family_config: str = "configs/tiny.py") -> str:
    config = load_config(str(ROOT / family_config))
    config.unlock()
    for key, value in overrides.items():
        node = config
        *parents, leaf = key.split(".")
        for name in parents:
            node = node[name]
        node[leaf] = value
    with pytest.raises(ConfigError) as e:
        models.validate(config)
    message = str(e.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "overrides, says",
    [
        ({"model.lora.rank": -1}, "config.model.lora.rank=-1: use 0 (off) or a positive rank"),
        ({"model.lora.rank": 4, "model.lora.targets": "q,gtae"}, "did you mean gate?"),
        ({"model.lora.rank": 4, "model.lora.targets": " , "}, "names no projection"),
        ({"model.lora.rank": 4, "model.lora.dropout": 1.0}, "dropout in [0, 1)"),
        ({"model.lora.rank": 4, "mesh.pipeline": 2}, "set config.mesh.pipeline=1"),
        ({"model.lora.rank": 4, "offload.policy": "optimizer"}, "config.offload.policy=none"),
        ({"model.lora.rank": 4, "model.family": "bert"}, "or use config.model.family=llama"),
    ],
)
def test_bad_settings_are_refused_in_one_line(overrides, says):
    assert says in refusal(overrides)


def test_experts_take_no_mlp_adapters():
    message = refusal({"model.lora.rank": 4, "model.lora.targets": "q,gate"}, RUNS["mixtral"][0])
    assert "keep the attention targets (q,k,v,o)" in message


def test_lora_off_adds_nothing():
    """rank 0: no adapter params, and the model config holds none (the step is the plain
    one: same params, same optimizer, same grads)."""
    exp = experiment("llama", "--config.model.lora.rank=0")
    assert not lora.adapters(exp.abstract_state.params)
    assert exp.model_config.lora is None and not exp.optimizer.adapters_only
    assert isinstance(exp.config.model.lora, ml_collections.ConfigDict)
