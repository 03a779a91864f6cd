"""`dslc import` and `dslc export`: Hugging Face checkpoints in and out.

Checkpoints are written here in the layout `save_pretrained` writes (tests/hf_checkpoints.py),
with random weights at the shrunk sizes of specs/gpt2.par, specs/llama.par and the other
family specs. Imported, the spec's forward gives the logits of an independent float64
forward of the same architecture; exported again, the safetensors file is the original byte
for byte. Every way a checkpoint can fail to fit is refused with its diagnostic and leaves
nothing behind.

Tolerance of the logits: 2e-5 relative (max |dslc - reference| / max |reference|). dslc
computes in f32, the reference in float64; f32 roundings through two layers give a few 1e-7
(measured: GPT-2 3.5e-7 on one device, 3.7e-7 on 2x2x2; Llama 3.6e-7 and 3.9e-7; GPT-NeoX
2.8e-7 and 2.3e-7; Gemma 2, four layers with logits capped at 3, 1.3e-6 on one device and
1.2e-6 on 4x2; ViT 3.4e-7 on one device and 3.7e-7 on 2x2, 8.0e-7 and 8.7e-7 absolute on
logits up to 2.3; T5, two encoder and two decoder blocks, 4.3e-7 on one device and 5.1e-7 on
2x2, held to 1e-5), while a mistake in a layout moves them by far more (GPT-2's first
`c_proj` transposed: 1.04; its q and k swapped: 0.32; GPT-NeoX's fused q, k, v read as q|k|v
blocks rather than head by head: 0.74; its rotary on every feature of a head rather than the
first quarter: 0.099; Gemma 2's post-attention and pre-MLP norms swapped: 0.89, its window
dropped: 1.22, on the odd layers rather than the even ones: 1.16, its caps on the scores and
on the logits dropped: 0.81 and 0.26; ViT's image with its channels reversed: 0.47, its rows
and columns swapped: 0.59, its patch kernel's height and width swapped, as reversing the
Conv2d's axes would: 0.50; T5's two position bias tables swapped: 0.47, its wi_0 and wi_1
swapped: 0.26, the encoder's bias left out: 0.20, a SiLU gate for the GELU: 0.062, the
source tokens reversed (cross-attention reading another encoding): 0.30).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dslc import cli
from tests.conftest import ROOT, SPECS
from tests.hf_checkpoints import (
    GEMMA2_CONFIG,
    GEMMA2_SET,
    GPT2_CONFIG,
    GPT2_SET,
    GPT_NEOX_CONFIG,
    GPT_NEOX_SET,
    LLAMA_CONFIG,
    LLAMA_SET,
    MIXTRAL_CONFIG,
    MIXTRAL_SET,
    QWEN2_MOE_CONFIG,
    QWEN2_MOE_SET,
    QWEN3_MOE_CONFIG,
    QWEN3_MOE_SET,
    T5_CONFIG,
    T5_SET,
    VIT_CONFIG,
    VIT_SET,
    gemma2_logits,
    gemma2_tensors,
    gpt2_logits,
    gpt2_tensors,
    gpt_neox_logits,
    gpt_neox_tensors,
    llama_logits,
    llama_tensors,
    mixtral_tensors,
    qwen2_moe_tensors,
    qwen3_moe_tensors,
    t5_logits,
    t5_tensors,
    vit_logits,
    vit_tensors,
    write_checkpoint,
)

TOLERANCE = 2e-5
GPT2 = SPECS / "gpt2.par"
VIT = SPECS / "vit.par"


def relative_error(got: Any, want: Any) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def flags(values: dict[str, object]) -> list[str]:
    return [part for name, value in values.items() for part in ("--set", f"{name}={value}")]


def run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def f32_llama(folder: Path, name: str = "llama") -> Path:
    """specs/llama.par (or another spec of specs/) computing in f32, to compare with a float64
    forward at f32's tolerance (the bf16 casts are tested on their own in test_numerics)."""
    text = (SPECS / f"{name}.par").read_text()
    assert "compute_dtype bf16" in text
    path = folder / f"{name}_f32.par"
    path.write_text(text.replace("compute_dtype bf16", "compute_dtype f32"))
    return path


def declared_at(name: str, spec: str) -> int:
    """The line of specs/`spec`.par that declares constant `name`: where a disagreement with
    it is reported."""
    lines = (SPECS / f"{spec}.par").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.startswith(f"const {name} "))


EPS_LINE = declared_at("eps", "llama")


def batch(vocab: int, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=(8, 16)).astype(np.int32)
    return {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1)}


def images(seed: int = 1) -> dict[str, np.ndarray]:
    """A batch of specs/vit.par's images at VIT_SET's sizes, [batch, height, width, channels]
    as the spec reads them (the reference takes them [batch, channels, height, width])."""
    rng = np.random.default_rng(seed)
    return {"images": rng.standard_normal((8, 16, 16, 3)).astype(np.float32)}


def logits_of(
    capsys: pytest.CaptureFixture[str],
    spec: Path,
    weights: Path,
    inputs: dict[str, np.ndarray],
    sizes: dict[str, object],
    mesh: str | None,
    where: Path,
) -> np.ndarray:
    np.savez(where / "inputs.npz", **inputs)
    mesh_flags = ["--mesh", mesh] if mesh else []
    code, _, err = run(
        capsys,
        "run",
        spec,
        *mesh_flags,
        "--weights",
        weights,
        "--inputs",
        where / "inputs.npz",
        "-o",
        where / "out.npz",
        *flags(sizes),
    )
    assert code == 0, err
    with np.load(where / "out.npz") as out:
        return np.asarray(out["output"])


# ---- the happy paths -------------------------------------------------------------------------------


def imported(
    root: Path, config: dict[str, Any], tensors: dict[str, np.ndarray], spec: Path, sizes: dict[str, object]
) -> dict[str, Any]:
    """A checkpoint of `config` made of `tensors`, written under `root`, and its import into
    `spec` at `sizes`."""
    folder = write_checkpoint(root / "checkpoint", config, tensors)
    weights = root / "weights.npz"
    assert cli.main(["import", str(spec), str(folder), "-o", str(weights), *flags(sizes)]) == 0
    return {"root": root, "folder": folder, "tensors": tensors, "weights": weights, "spec": spec}


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A GPT-2 checkpoint (tied head) and its import."""
    return imported(tmp_path_factory.mktemp("gpt2"), GPT2_CONFIG, gpt2_tensors(GPT2_CONFIG), GPT2, GPT2_SET)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("llama")
    return imported(root, LLAMA_CONFIG, llama_tensors(LLAMA_CONFIG), f32_llama(root), LLAMA_SET)


@pytest.fixture(scope="module")
def gpt_neox(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("gpt_neox")
    tensors = gpt_neox_tensors(GPT_NEOX_CONFIG)
    return imported(root, GPT_NEOX_CONFIG, tensors, f32_llama(root, "gpt_neox"), GPT_NEOX_SET)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A Gemma 2 checkpoint (tied head) and its import into specs/gemma2.par in f32."""
    root = tmp_path_factory.mktemp("gemma2")
    return imported(root, GEMMA2_CONFIG, gemma2_tensors(GEMMA2_CONFIG), f32_llama(root, "gemma2"), GEMMA2_SET)


@pytest.fixture(scope="module")
def vit(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A ViT checkpoint (three channels, ten labels) and its import into specs/vit.par, which
    computes in f32."""
    return imported(tmp_path_factory.mktemp("vit"), VIT_CONFIG, vit_tensors(VIT_CONFIG), VIT, VIT_SET)


@pytest.fixture(scope="module")
def t5(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A T5 v1.1 checkpoint (gated-GELU MLP, untied head) and its import into specs/t5.par in f32."""
    root = tmp_path_factory.mktemp("t5")
    return imported(root, T5_CONFIG, t5_tensors(T5_CONFIG), f32_llama(root, "t5"), T5_SET)


def translations(seed: int = 1) -> dict[str, np.ndarray]:
    """A batch for specs/t5.par at T5_SET's sizes: 16 source tokens, and 8 target tokens
    shifted right behind the decoder's start token (0, T5's) as the decoder reads them."""
    rng = np.random.default_rng(seed)
    source = rng.integers(0, T5_SET["vocab"], size=(8, 16)).astype(np.int32)
    targets = rng.integers(0, T5_SET["vocab"], size=(8, 8)).astype(np.int32)
    decoder = np.concatenate([np.zeros((8, 1), np.int32), targets[:, :-1]], axis=1)
    return {"tokens": source, "decoder_tokens": decoder, "targets": targets}


# The mixture-of-experts families: config, the --set that shrinks the spec, the tensors.
MOE_FAMILIES = {
    "mixtral": (MIXTRAL_CONFIG, MIXTRAL_SET, mixtral_tensors),
    "qwen3_moe": (QWEN3_MOE_CONFIG, QWEN3_MOE_SET, qwen3_moe_tensors),
    "qwen2_moe": (QWEN2_MOE_CONFIG, QWEN2_MOE_SET, qwen2_moe_tensors),
}


def _imported_moe(root: Path, family: str) -> dict[str, Any]:
    config, sizes, make = MOE_FAMILIES[family]
    return imported(root, config, make(config), f32_llama(root, family), sizes) | {"family": family}


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _imported_moe(tmp_path_factory.mktemp("mixtral"), "mixtral")


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _imported_moe(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _imported_moe(tmp_path_factory.mktemp("qwen2_moe"), "qwen2_moe")


@pytest.mark.parametrize("mesh", ["1x1x1", None], ids=["one device", "2x2x2"])
def test_imported_gpt2_computes_the_reference_logits(
    gpt2: dict[str, Any], mesh: str | None, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """On 2x2x2 the head is tied to the embedding through the pipeline and the vocabulary of
    95 padded to 96 over `model`: the logits are still the checkpoint's, 95 wide."""
    inputs = batch(GPT2_SET["vocab"])
    got = logits_of(capsys, GPT2, gpt2["weights"], inputs, GPT2_SET, mesh, tmp_path)
    want = gpt2_logits(GPT2_CONFIG, gpt2["tensors"], inputs["tokens"])
    assert relative_error(got, want) <= TOLERANCE


@pytest.mark.parametrize("mesh", ["1x1x1", None], ids=["one device", "2x2x2"])
def test_imported_llama_computes_the_reference_logits(
    llama: dict[str, Any], mesh: str | None, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    inputs = batch(96)
    got = logits_of(capsys, llama["spec"], llama["weights"], inputs, LLAMA_SET, mesh, tmp_path)
    want = llama_logits(LLAMA_CONFIG, llama["tensors"], inputs["tokens"])
    assert relative_error(got, want) <= TOLERANCE


@pytest.mark.parametrize("mesh", ["1x1x1", None], ids=["one device", "2x2x2"])
def test_imported_gpt_neox_computes_the_reference_logits(
    gpt_neox: dict[str, Any], mesh: str | None, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """specs/gpt_neox.par (Pythia's parallel blocks, x + attn(ln_1(x)) + mlp(ln_2(x)), rotary
    on 2 of each head's 8 features) against GPTNeoXForCausalLM's forward: `query_key_value`
    split head by head. On 2x2x2 the two branches' row-parallel outputs are summed before
    their one reduction over `model`, and the blocks split over two pipeline stages."""
    inputs = batch(96, seed=9)
    got = logits_of(capsys, gpt_neox["spec"], gpt_neox["weights"], inputs, GPT_NEOX_SET, mesh, tmp_path)
    assert relative_error(got, gpt_neox_logits(GPT_NEOX_CONFIG, gpt_neox["tensors"], inputs["tokens"])) <= TOLERANCE


@pytest.mark.parametrize("mesh", ["1x1", None], ids=["one device", "4x2"])
def test_imported_gemma2_computes_the_reference_logits(
    gemma2: dict[str, Any], mesh: str | None, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """specs/gemma2.par against Gemma2ForCausalLM's forward: its four norms a layer scaling by
    1 + their weight, the embedding times sqrt(d), a window of 4 over 16 tokens on the even
    layers, scores and logits capped. On 4x2 the heads, the MLP and the vocabulary split over
    `model`, the batch over `data`, and the tied head reads its split table."""
    inputs = batch(96, seed=13)
    got = logits_of(capsys, gemma2["spec"], gemma2["weights"], inputs, GEMMA2_SET, mesh, tmp_path)
    want = gemma2_logits(GEMMA2_CONFIG, gemma2["tensors"], inputs["tokens"])
    assert relative_error(got, want) <= TOLERANCE
    # Each piece matters: the forward without it gives other logits.
    for without in (
        {"sliding_window": 16},  # every layer over the whole sequence
        {"layer_types": ["full_attention", "sliding_attention"] * 2},  # the window on the odd layers
        {"attn_logit_softcapping": None},
        {"final_logit_softcapping": None},
    ):
        other = gemma2_logits({**GEMMA2_CONFIG, **without}, gemma2["tensors"], inputs["tokens"])
        assert relative_error(other, got) > 0.1, without


def test_a_gemma2_scaled_by_its_own_query_scalar_imports_and_computes_its_logits(
    gemma2: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Gemma-2-27B scales the scores of its heads of 128 by 1/sqrt(144), not 1/sqrt(128): a
    checkpoint whose query_pre_attn_scalar (12) is not its head width (16) imports into the
    spec whose attention layers say `scale=12 ** -0.5`, computes transformers' logits, and
    exports the scalar back."""
    config = {**GEMMA2_CONFIG, "query_pre_attn_scalar": 12}
    folder = write_checkpoint(tmp_path / "checkpoint", config, gemma2["tensors"])
    text = Path(gemma2["spec"]).read_text()
    scaled = text.replace("softcap=attn_cap)", f"softcap=attn_cap, scale={12**-0.5!r})")
    assert scaled.count("scale=") == text.count("scale=") + 2
    spec = tmp_path / "gemma2_scaled.par"
    spec.write_text(scaled)
    weights = tmp_path / "weights.npz"
    code, _, err = run(capsys, "import", spec, folder, "-o", weights, *flags(GEMMA2_SET))
    assert code == 0, err
    inputs = batch(96, seed=13)
    got = logits_of(capsys, spec, weights, inputs, GEMMA2_SET, "1x1", tmp_path)
    assert relative_error(got, gemma2_logits(config, gemma2["tensors"], inputs["tokens"])) <= TOLERANCE
    # 1/sqrt(16) in its place gives other logits.
    assert relative_error(got, gemma2_logits(GEMMA2_CONFIG, gemma2["tensors"], inputs["tokens"])) > 10 * TOLERANCE
    code, _, err = run(capsys, "export", spec, "--weights", weights, "-o", tmp_path / "out", *flags(GEMMA2_SET))
    assert code == 0, err
    assert json.loads((tmp_path / "out" / "config.json").read_text())["query_pre_attn_scalar"] == 12


@pytest.mark.parametrize("mesh", ["1x1", None], ids=["one device", "2x2"])
def test_imported_vit_computes_the_reference_logits(
    vit: dict[str, Any], mesh: str | None, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """specs/vit.par against ViTForImageClassification's forward, which takes the same images
    [batch, channels, height, width]: the Conv2d's kernel turned into the conv's, the patches
    read row by row, the class token first. On 2x2 the heads and the MLP split over `model`,
    the batch over `data`."""
    inputs = images(seed=3)
    got = logits_of(capsys, vit["spec"], vit["weights"], inputs, VIT_SET, mesh, tmp_path)
    pixels = inputs["images"].transpose(0, 3, 1, 2)
    want = vit_logits(VIT_CONFIG, vit["tensors"], pixels)
    # Logits up to 2.3 here: 1e-5 absolute is 4e-6 of them, within TOLERANCE and 10x the f32 error seen.
    assert got.shape == (8, 10) and relative_error(got, want) <= TOLERANCE and np.max(np.abs(got - want)) <= 1e-5
    # Each layout matters: the image or the kernel read another way gives other logits.
    kernel = "vit.embeddings.patch_embeddings.projection.weight"
    for name, tensors, pixel_values in (
        ("channels reversed", vit["tensors"], pixels[:, ::-1]),
        ("rows and columns swapped", vit["tensors"], pixels.transpose(0, 1, 3, 2)),
        (
            "kernel's height and width swapped",
            {**vit["tensors"], kernel: vit["tensors"][kernel].transpose(0, 1, 3, 2)},
            pixels,
        ),
    ):
        assert relative_error(vit_logits(VIT_CONFIG, tensors, pixel_values), got) > 0.1, name


@pytest.mark.parametrize("mesh", ["1x1", None], ids=["one device", "2x2"])
def test_imported_t5_computes_the_reference_logits(
    t5: dict[str, Any], mesh: str | None, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """specs/t5.par against T5ForConditionalGeneration's forward: the encoder a stream the
    cross-attention reads, unscaled scores plus each stack's bucketed bias, the gated-GELU
    MLP, the untied head. On 2x2 the heads (and the bias tables' heads), the MLP and the
    vocabulary split over `model`, the batch over `data`. Tolerance 1e-5 relative: f32
    through four blocks, where 4.3e-7 (one device) and 5.1e-7 (2x2) were seen."""
    inputs = translations(seed=5)
    got = logits_of(capsys, t5["spec"], t5["weights"], inputs, T5_SET, mesh, tmp_path)
    want = t5_logits(T5_CONFIG, t5["tensors"], inputs["tokens"], inputs["decoder_tokens"])
    assert got.shape == (8, 8, 64) and relative_error(got, want) <= 1e-5
    # Each piece of the mapping matters: read another way, the checkpoint gives other logits.
    tensors, tokens = t5["tensors"], inputs["tokens"]
    bias = "{}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    encoder_bias, decoder_bias = bias.format("encoder"), bias.format("decoder")
    gates_swapped = dict(tensors)
    for stack, mlp in (("encoder", 1), ("decoder", 2)):
        for i in (0, 1):
            at = f"{stack}.block.{i}.layer.{mlp}.DenseReluDense."
            gates_swapped[at + "wi_0.weight"], gates_swapped[at + "wi_1.weight"] = (
                tensors[at + "wi_1.weight"],
                tensors[at + "wi_0.weight"],
            )
    for name, config, changed, source in (
        (
            "bias tables swapped",
            T5_CONFIG,
            {**tensors, encoder_bias: tensors[decoder_bias], decoder_bias: tensors[encoder_bias]},
            tokens,
        ),
        ("wi_0 and wi_1 swapped", T5_CONFIG, gates_swapped, tokens),
        ("encoder's bias left out", T5_CONFIG, {**tensors, encoder_bias: 0 * tensors[encoder_bias]}, tokens),
        ("a silu gate", {**T5_CONFIG, "feed_forward_proj": "gated-silu"}, tensors, tokens),
        ("the source reversed", T5_CONFIG, tensors, tokens[:, ::-1]),
    ):
        moved = relative_error(t5_logits(config, changed, source, inputs["decoder_tokens"]), got)
        assert moved > 0.05, (name, moved)  # 5000 times the tolerance


def test_a_gpt_neox_without_attention_biases_imports_and_exports_again(
    gpt_neox: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`attention_bias: false` leaves `query_key_value` and `dense` without biases: the
    spec's attention without `bias=true` (and their shardings) takes it, computes the
    reference and writes it back byte for byte."""
    config = {**GPT_NEOX_CONFIG, "attention_bias": False}
    tensors = gpt_neox_tensors(config, seed=10)
    assert not any(n.endswith(("query_key_value.bias", "dense.bias")) for n in tensors)
    folder = write_checkpoint(tmp_path / "unbiased", config, tensors)
    text = Path(gpt_neox["spec"]).read_text()
    biased = "bias=true) shard q[_, model], q_bias[model], k[_, model], k_bias[model], v[_, model], v_bias[model],"
    assert biased in text
    spec = tmp_path / "unbiased.par"
    spec.write_text(text.replace(biased, "bias=false) shard q[_, model], k[_, model], v[_, model],"))
    weights = tmp_path / "w.npz"
    code, _, err = run(capsys, "import", spec, folder, "-o", weights, *flags(GPT_NEOX_SET))
    assert code == 0, err
    inputs = batch(96, seed=11)
    got = logits_of(capsys, spec, weights, inputs, GPT_NEOX_SET, "1x1x1", tmp_path)
    assert relative_error(got, gpt_neox_logits(config, tensors, inputs["tokens"])) <= TOLERANCE
    code, _, err = run(capsys, "export", spec, "--weights", weights, "-o", tmp_path / "out", *flags(GPT_NEOX_SET))
    assert code == 0, err
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    assert _exported(tmp_path / "out")[0]["attention_bias"] is False


def test_a_tied_gpt_neox_stores_its_head_as_embed_out_if_at_all(
    gpt_neox: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """GPT-NeoX's head is `embed_out`, not `lm_head`: a tied checkpoint may leave it out or
    store the embedding there, and one whose `embed_out` differs is refused."""
    config = {**GPT_NEOX_CONFIG, "tie_word_embeddings": True}
    tensors = gpt_neox_tensors(config, seed=12)
    assert "embed_out.weight" not in tensors
    spec = tmp_path / "tied.par"
    spec.write_text(
        Path(gpt_neox["spec"]).read_text().replace("const batch = 16", "const batch = 16\nconst tied = true")
    )
    table = tensors["gpt_neox.embed_in.weight"]
    for name, stored, said in [
        ("left out", {}, None),
        ("stored", {"embed_out.weight": table}, None),
        ("stored apart", {"embed_out.weight": table + 1}, "error[C006]: `embed_out.weight` differs from the embedding"),
    ]:
        folder = write_checkpoint(tmp_path / name, config, {**tensors, **stored})
        weights = tmp_path / f"{name}.npz"
        code, _, err = run(capsys, "import", spec, folder, "-o", weights, *flags(GPT_NEOX_SET))
        if said is not None:
            assert code == 1 and said in err and not weights.exists(), err
            continue
        assert code == 0, err
        with np.load(weights) as got:
            assert np.array_equal(got["head.kernel"], table.T) and np.array_equal(got["embed.table"], table)


def test_imported_mistral_with_a_sliding_window_computes_the_reference_logits(
    llama: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A window of 8 over 16 tokens: every query past the eighth sees only its 8 latest keys,
    as Mistral's attention does; the spec says so with the attention's `window`."""
    config = {**LLAMA_CONFIG, "model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 8}
    tensors = llama_tensors(config, seed=4)
    folder = write_checkpoint(tmp_path / "mistral", config, tensors)
    text = Path(llama["spec"]).read_text()
    spec = tmp_path / "mistral.par"
    spec.write_text(text.replace("attention(d, heads,", "attention(d, heads, window=8,"))
    code, _, err = run(capsys, "import", spec, folder, "-o", tmp_path / "w.npz", *flags(LLAMA_SET))
    assert code == 0, err
    inputs = batch(96, seed=5)
    got = logits_of(capsys, spec, tmp_path / "w.npz", inputs, LLAMA_SET, "1x1x1", tmp_path)
    want = llama_logits(config, tensors, inputs["tokens"])
    assert relative_error(got, want) <= TOLERANCE
    # The window matters: the same weights over the whole sequence give other logits.
    assert relative_error(got, llama_logits({**config, "sliding_window": None}, tensors, inputs["tokens"])) > 1e-3


def test_imported_qwen2_with_qkv_biases_computes_the_reference_logits(
    llama: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = {**LLAMA_CONFIG, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": True}
    del config["attention_bias"], config["mlp_bias"]
    tensors = llama_tensors(config, seed=3)
    folder = write_checkpoint(tmp_path / "qwen2", config, tensors)
    sizes = {**LLAMA_SET, "qkv_bias": "true", "tied": "true"}
    code, out, err = run(capsys, "import", llama["spec"], folder, "-o", tmp_path / "w.npz", *flags(sizes))
    assert code == 0, err
    assert "27 weights, 21,792 parameters from 26 tensors of a qwen2 checkpoint" in out  # the head from the table
    inputs = batch(96, seed=2)
    got = logits_of(capsys, llama["spec"], tmp_path / "w.npz", inputs, sizes, "1x1x1", tmp_path)
    assert relative_error(got, llama_logits(config, tensors, inputs["tokens"])) <= TOLERANCE


@pytest.mark.parametrize("mesh", ["1x1x1", None], ids=["one device", "2x2x2"])
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_imported_mixture_of_experts_computes_the_reference_logits_and_loss(
    family: str,
    mixtral: dict[str, Any],
    qwen3_moe: dict[str, Any],
    qwen2_moe: dict[str, Any],
    mesh: str | None,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    """specs/mixtral.par and specs/qwen3_moe.par, dropless SwiGLU experts (Qwen3's with each
    head's query and key normalised and a head wider than d / heads), on one device and on
    data x expert x model (2x2x2: tokens gathered along `expert`, experts' hidden width over
    `model`): the logits and the cross-entropy of the float64 forward of MixtralForCausalLM
    and Qwen3MoeForCausalLM, and specs/qwen2_moe.par with its gated shared expert against
    Qwen2MoeForCausalLM's (their load-balancing losses off, as transformers leaves them
    without output_router_logits)."""
    case = {"mixtral": mixtral, "qwen3_moe": qwen3_moe, "qwen2_moe": qwen2_moe}[family]
    config, sizes, _ = MOE_FAMILIES[family]
    inputs = batch(96, seed=6)
    np.savez(tmp_path / "inputs.npz", **inputs)
    mesh_flags = ["--mesh", mesh] if mesh else []
    spec, weights = case["spec"], case["weights"]
    code, _, err = run(
        capsys, "run", spec, *mesh_flags, "--weights", weights, "--inputs", tmp_path / "inputs.npz",
        "-o", tmp_path / "out.npz", "--grads", *flags(sizes),
    )  # fmt: skip
    assert code == 0, err
    want = llama_logits(config, case["tensors"], inputs["tokens"])
    with np.load(tmp_path / "out.npz") as out:
        assert relative_error(out["output"], want) <= TOLERANCE
        shifted = want - want.max(-1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        loss = -np.take_along_axis(log_probs, inputs["targets"][..., None], axis=-1).mean()
        assert relative_error(out["loss"], loss) <= TOLERANCE
    # The routing matters: every expert's output at the same gate would be other logits.
    even = {**case["tensors"]}
    for name in [n for n in even if n.endswith("gate.weight") and "experts" not in n]:
        even[name] = np.zeros_like(even[name])
    assert relative_error(llama_logits(config, even, inputs["tokens"]), want) > 1e-3


def test_a_spec_whose_experts_are_not_mixtrals_is_refused(
    mixtral: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A capacity drops tokens and GELU experts compute another function: C002 for each, with
    the fix, and nothing written."""
    text = Path(mixtral["spec"]).read_text().replace("capacity=none, activation=swiglu", "capacity=1.25")
    text = text.replace(", w_gate[expert, _, model]", "")
    spec = tmp_path / "not_mixtral.par"
    spec.write_text(text)
    code, _, err = run(capsys, "import", spec, mixtral["folder"], "-o", tmp_path / "w.npz", *flags(MIXTRAL_SET))
    assert code != 0 and not (tmp_path / "w.npz").exists()
    assert "C002" in err and "the spec is not built like a Mixtral: it drops no token" in err
    assert "write `capacity=none`" in err and "its experts are SwiGLU" in err


@pytest.mark.parametrize(
    "family", ["gpt2", "llama", "mixtral", "qwen3_moe", "qwen2_moe", "gpt_neox", "gemma2", "vit", "t5"]
)
def test_export_writes_the_checkpoint_back_byte_for_byte(
    family: str,
    gpt2: dict[str, Any],
    llama: dict[str, Any],
    mixtral: dict[str, Any],
    qwen3_moe: dict[str, Any],
    qwen2_moe: dict[str, Any],
    gpt_neox: dict[str, Any],
    gemma2: dict[str, Any],
    vit: dict[str, Any],
    t5: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    case, spec, sizes, config = {
        "gpt2": (gpt2, GPT2, GPT2_SET, GPT2_CONFIG),
        "llama": (llama, llama["spec"], LLAMA_SET, LLAMA_CONFIG),
        "mixtral": (mixtral, mixtral["spec"], MIXTRAL_SET, MIXTRAL_CONFIG),
        "qwen3_moe": (qwen3_moe, qwen3_moe["spec"], QWEN3_MOE_SET, QWEN3_MOE_CONFIG),
        "qwen2_moe": (qwen2_moe, qwen2_moe["spec"], QWEN2_MOE_SET, QWEN2_MOE_CONFIG),
        "gpt_neox": (gpt_neox, gpt_neox["spec"], GPT_NEOX_SET, GPT_NEOX_CONFIG),
        "gemma2": (gemma2, gemma2["spec"], GEMMA2_SET, GEMMA2_CONFIG),
        "vit": (vit, vit["spec"], VIT_SET, VIT_CONFIG),
        "t5": (t5, t5["spec"], T5_SET, T5_CONFIG),
    }[family]
    out = tmp_path / "exported"
    code, printed, err = run(capsys, "export", spec, "--weights", case["weights"], "-o", out, *flags(sizes))
    assert code == 0, err
    assert (out / "model.safetensors").read_bytes() == (case["folder"] / "model.safetensors").read_bytes()
    written = json.loads((out / "config.json").read_text())
    same = set(written) & set(config)
    assert {k: written[k] for k in same} == {k: config[k] for k in same}
    assert same >= {"torch_dtype"} | ({"id2label", "image_size"} if family == "vit" else {"vocab_size"})
    assert family not in ("gpt2", "gemma2") or (
        "tied to the embedding" in printed and written["tie_word_embeddings"] is True
    )


def test_sharded_and_unprefixed_checkpoints_import_alike(
    gpt2: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    sharded = write_checkpoint(tmp_path / "sharded", GPT2_CONFIG, gpt2["tensors"], shards=3)
    assert len(list(sharded.glob("*.safetensors"))) == 3
    # Older GPT-2 checkpoints name the tensors without `transformer.` and keep the causal mask.
    old = {name.removeprefix("transformer."): t for name, t in gpt2["tensors"].items()}
    old["h.0.attn.bias"] = np.tril(np.ones((1, 1, 32, 32), np.float32))
    unprefixed = write_checkpoint(tmp_path / "old", GPT2_CONFIG, old)
    with np.load(gpt2["weights"]) as want:
        for folder in (sharded, unprefixed):
            code, _, err = run(capsys, "import", GPT2, folder, "-o", tmp_path / "w.npz", *flags(GPT2_SET))
            assert code == 0, err
            with np.load(tmp_path / "w.npz") as got:
                assert sorted(got.files) == sorted(want.files)
                assert all(np.array_equal(got[n], want[n]) for n in want.files)


def test_import_reads_bf16_checkpoints_exactly(
    gpt2: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import ml_dtypes

    halved = {n: t.astype(ml_dtypes.bfloat16) for n, t in gpt2["tensors"].items()}
    folder = write_checkpoint(tmp_path / "bf16", {**GPT2_CONFIG, "torch_dtype": "bfloat16"}, halved)
    code, _, err = run(capsys, "import", GPT2, folder, "-o", tmp_path / "w.npz", *flags(GPT2_SET))
    assert code == 0, err
    with np.load(tmp_path / "w.npz") as got:
        table = got["wte.table"]
        assert table.dtype == np.float32
        assert np.array_equal(table, halved["transformer.wte.weight"].astype(np.float32))


# ---- refusals: a diagnostic, exit 1, and nothing written -------------------------------------------


def _transposed_blocks(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The blocks' matrices in nn.Linear's [out, in], as a careless conversion writes them."""
    return {n: t.T.copy() if t.ndim == 2 and ".h." in n else t for n, t in tensors.items()}


def _truncate(folder: Path) -> None:
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])


def _pickles_only(folder: Path) -> None:
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")


def _index_names_a_lost_shard(folder: Path) -> None:
    next(iter(sorted(folder.glob("model-*.safetensors")))).unlink()


# name: (config change, tensors change, files change, shards, what stderr must say)
REFUSED: dict[str, tuple[dict[str, object], Any, Any, int, list[str]]] = {
    "config disagrees": (
        {"n_head": 8},
        None,
        None,
        1,
        [
            "gpt2.par:27:1: error[C001]: config.json's `n_head` is 8, but the spec's number of attention heads is 4",
            " 27 | const heads = 12",
            "used by `h.0.attn`",
            "= note: `heads` is 4 here, set on the command line",
            "= help: --set heads=8",
        ],
    ),
    "malformed config": (
        {"n_head": "4"},
        None,
        None,
        1,
        ["error[C004]: 1 unusable value", '`n_head`: input should be a valid integer, got "4"'],
    ),
    "unsupported config": (
        {"activation_function": "relu"},
        None,
        None,
        1,
        ["error[C003]: activation_function 'relu' is not one dslc computes"],
    ),
    "missing tensor": (
        {},
        lambda t: {n: v for n, v in t.items() if n != "transformer.h.1.mlp.c_fc.bias"},
        None,
        1,
        ["error[C006]: 1 tensor of the spec missing: `transformer.h.1.mlp.c_fc.bias`"],
    ),
    "extra tensor": (
        {},
        lambda t: {**t, "transformer.h.0.attn.lora_a": t["transformer.h.0.ln_1.bias"]},
        None,
        1,
        ["error[C006]: 1 tensor the spec has no place for: `transformer.h.0.attn.lora_a`"],
    ),
    "wrong shape": (
        {},
        lambda t: {**t, "transformer.h.0.mlp.c_fc.weight": t["transformer.h.0.mlp.c_fc.weight"][:, :64].copy()},
        None,
        1,
        ["error[C006]: `transformer.h.0.mlp.c_fc.weight` is [32, 64], the spec needs [32, 128]"],
    ),
    "transposed matrices": (
        {},
        _transposed_blocks,
        None,
        1,
        [
            "error[C006]: 6 matrices stored the other way round (`transformer.h.0.attn.c_attn.weight`,",
            "GPT-2 stores `transformer.h.0.attn.c_attn.weight` as [32, 96]",
            "square matrices (`transformer.h.0.attn.c_proj.weight`, `transformer.h.1.attn.c_proj.weight`) look the "
            "same either way round",
        ],
    ),
    "truncated file": ({}, None, _truncate, 1, ["model.safetensors: error[C005]: not a readable safetensors file"]),
    "pickles only": ({}, None, _pickles_only, 1, ["error[C005]: no model.safetensors", "never pickles"]),
    "lost shard": (
        {},
        None,
        _index_names_a_lost_shard,
        3,
        ["model.safetensors.index.json: error[C005]: names files that are not in the folder"],
    ),
    "tied head stored apart": (
        {},
        lambda t: {**t, "lm_head.weight": t["transformer.wte.weight"] + 1},
        None,
        1,
        [
            "model.safetensors: error[C006]: `lm_head.weight` differs from the embedding `transformer.wte.weight`, "
            "but config.json ties them (tie_word_embeddings)"
        ],
    ),
    "untied checkpoint": (
        {"tie_word_embeddings": False},
        lambda t: {**t, "lm_head.weight": t["transformer.wte.weight"] + 1},
        None,
        1,
        [
            "error[C001]: config.json's `tie_word_embeddings` is false, but the spec's head, which reads the "
            "embedding's table (`tie`), is true",
            "= help: give the head a kernel of its own: drop its `tie`",
        ],
    ),
    "another family": (
        {**LLAMA_CONFIG, "n_head": None},
        lambda t: llama_tensors(LLAMA_CONFIG),
        None,
        1,
        [
            "error[C002]: the spec is not built like a Llama: a residual branch should come here, "
            "not `position_embed` `wpe`"
        ],
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_checkpoint_that_does_not_fit_is_refused_and_nothing_is_written(
    name: str, gpt2: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config_change, tensors_change, files_change, shards, said = REFUSED[name]
    config = {k: v for k, v in {**GPT2_CONFIG, **config_change}.items() if v is not None or k == "n_inner"}
    if "model_type" in config_change:
        config = {k: v for k, v in config.items() if k in LLAMA_CONFIG}
    tensors = tensors_change(gpt2["tensors"]) if tensors_change else gpt2["tensors"]
    folder = write_checkpoint(tmp_path / "checkpoint", config, tensors, shards=shards)
    if files_change:
        files_change(folder)
    out = tmp_path / "out"
    out.mkdir()
    code, printed, err = run(capsys, "import", GPT2, folder, "-o", out / "w.npz", *flags(GPT2_SET))
    assert code == 1, err
    for words in said:
        assert words in err, err
    assert "Traceback" not in err and printed == ""
    assert list(out.iterdir()) == []  # neither the weights nor a temporary file


def _exported(folder: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    from safetensors.numpy import load_file

    return json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))


def test_a_tied_gpt2_exports_its_one_table_however_trained(
    gpt2: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """specs/gpt2.par's head reads the embedding's table: one weight, so a trained model is
    still a tied checkpoint; `--untie` writes the table twice."""
    with np.load(gpt2["weights"]) as w:
        trained = {n: w[n] for n in w.files}
    assert "lm_head.kernel" not in trained and trained["wte.table"].shape == (95, 32)
    trained["wte.table"] = trained["wte.table"] + 0.5
    np.savez(tmp_path / "trained.npz", **trained)
    for untie in (False, True):
        out = tmp_path / ("two" if untie else "one")
        argv = ["export", GPT2, "--weights", tmp_path / "trained.npz", "-o", out, *flags(GPT2_SET)]
        code, printed, err = run(capsys, *argv, *(["--untie"] if untie else []))
        assert code == 0, err
        config, written = _exported(out)
        assert config["tie_word_embeddings"] is not untie and ("tied to the embedding" in printed) is not untie
        assert np.array_equal(written["transformer.wte.weight"], trained["wte.table"])
        assert ("lm_head.weight" in written) is untie
        if untie:
            assert np.array_equal(written["lm_head.weight"], trained["wte.table"])


def test_export_refuses_a_head_copy_that_is_no_longer_its_embedding_unless_untied(
    llama: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """specs/llama.par's head is a weight of its own: with `tied=true` it holds a copy of the
    table, which export writes as a tied checkpoint only while it still is one."""
    sizes = {**LLAMA_SET, "tied": "true"}
    out = tmp_path / "exported"
    argv = ["export", llama["spec"], "--weights", llama["weights"], "-o", out, *flags(sizes)]
    code, _, err = run(capsys, *argv)
    assert code == 1
    assert "error[C007]: the head `head.kernel` is no longer the embedding `embed.table` it is tied to" in err
    assert "--untie" in err and not out.exists()
    code, printed, err = run(capsys, *argv, "--untie")
    assert code == 0, err
    assert "tied" not in printed
    config, written = _exported(out)
    assert config["tie_word_embeddings"] is False
    with np.load(llama["weights"]) as w:
        assert np.array_equal(written["lm_head.weight"], w["head.kernel"].T)
        assert np.array_equal(written["model.embed_tokens.weight"], w["embed.table"])


def test_a_tied_checkpoint_may_store_its_head_as_the_embedding(
    gpt2: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    tensors = gpt2["tensors"]
    both = write_checkpoint(
        tmp_path / "both", GPT2_CONFIG, {**tensors, "lm_head.weight": tensors["transformer.wte.weight"]}
    )
    code, _, err = run(capsys, "import", GPT2, both, "-o", tmp_path / "w.npz", *flags(GPT2_SET))
    assert code == 0, err
    with np.load(gpt2["weights"]) as want, np.load(tmp_path / "w.npz") as got:
        assert sorted(got.files) == sorted(want.files)
        assert all(np.array_equal(got[n], want[n]) for n in want.files)


def test_export_refuses_weights_of_another_spec(
    gpt2: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with np.load(gpt2["weights"]) as w:
        weights = {n: w[n] for n in w.files if n != "h.1.fc.bias"}
    np.savez(tmp_path / "w.npz", **weights)
    code, _, err = run(
        capsys, "export", GPT2, "--weights", tmp_path / "w.npz", "-o", tmp_path / "out", *flags(GPT2_SET)
    )
    assert code == 1
    assert "error[C007]: the weights do not fit the spec" in err and "1 missing (`h.1.fc.bias`)" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"model_type": "mistral", "sliding_window": 4096}, []),
        (
            {"rms_norm_eps": 1e-6},
            [
                f"llama_f32.par:{EPS_LINE}:1: error[C001]: config.json's `rms_norm_eps` is 1e-06",
                "= help: --set eps=1e-06",
            ],
        ),
        (
            {"tie_word_embeddings": True},
            ["error[C001]: config.json's `tie_word_embeddings` is true", "--set tied=true"],
        ),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, ["error[C003]: rope type 'llama3'"]),
        (
            {"model_type": "mistral", "sliding_window": 8},
            [
                "error[C001]: config.json's `sliding_window` is 8, but the spec's sliding window",
                "write `window=8` on the attention",
            ],
        ),
        ({"mlp_bias": True}, ["error[C003]: mlp_bias is true"]),
        # No constant holds it: the diagnostic points at the layer and says what to write there.
        (
            {"head_dim": 16},
            ["error[C001]: config.json's `head_dim` is 16, but the spec's head width is 8", "write `head_dim=16`"],
        ),
    ],
)
def test_a_llama_config_is_checked_before_a_tensor_is_read(
    change: dict[str, object],
    said: list[str],
    llama: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    folder = write_checkpoint(tmp_path / "checkpoint", {**LLAMA_CONFIG, **change}, llama["tensors"])
    # Every check above comes before the tensors: a checkpoint without them gives the same report.
    if said:
        (folder / "model.safetensors").unlink()
    code, _, err = run(capsys, "import", llama["spec"], folder, "-o", tmp_path / "w.npz", *flags(LLAMA_SET))
    assert code == (1 if said else 0), err
    for words in said:
        assert words in err, err
    assert (tmp_path / "w.npz").exists() == (not said)


ROPE_DIMS_LINE = declared_at("rope_dims", "gpt_neox")
FIRST_BRANCH_LINE = next(
    i for i, line in enumerate((SPECS / "gpt_neox.par").read_text().splitlines(), 1) if line.strip() == "branch {"
)
# transformers 5 keeps the rotary base and share in `rope_parameters`, which it reads first.
ROPE_PARAMETERS = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}


@pytest.mark.parametrize(
    ("change", "said"),
    [
        # Where both are given, `rope_parameters` decides, as in transformers 5.
        ({"rope_parameters": ROPE_PARAMETERS, "rotary_pct": 0.5}, []),
        (
            {"rotary_pct": 0.5},
            [
                f"gpt_neox_f32.par:{ROPE_DIMS_LINE}:1: error[C001]: config.json's `rotary_pct` is 0.5 (4 of each "
                "head's 8 features), but the spec's number of rotated features of each head is 2",
                "used by `layers.0.attn`",
                "= help: --set rope_dims=4",
            ],
        ),
        (
            {"rope_parameters": {**ROPE_PARAMETERS, "partial_rotary_factor": 1.0}},
            ["config.json's `rotary_pct` is 1.0 (8 of each head's 8 features)", "= help: --set rope_dims=8"],
        ),
        # No constant holds these: the diagnostic points at the layer and says what to write there.
        ({"rotary_emb_base": 500}, ["`rotary_emb_base` is 500", "write `rope_base=500.0` on the attention"]),
        (
            {"hidden_act": "gelu_new"},
            ['config.json\'s `hidden_act` is "gelu_new", but the spec\'s GELU is "gelu"', "`gelu()` for gelu_new"],
        ),
        (
            {"attention_bias": False},
            ["`attention_bias` is false, but the spec's use of attention biases is true", "leave out the attention's"],
        ),
        (
            {"use_parallel_residual": False},
            [
                "error[C003]: use_parallel_residual is false: dslc maps GPT-NeoX blocks whose attention and MLP read "
                "the same input"
            ],
        ),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, ["error[C003]: rope type 'linear'"]),
        ({"hidden_act": "relu"}, ["error[C003]: hidden_act 'relu' is not one dslc computes"]),
    ],
)
def test_a_gpt_neox_config_is_checked_before_a_tensor_is_read(
    change: dict[str, object],
    said: list[str],
    gpt_neox: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    folder = write_checkpoint(tmp_path / "checkpoint", {**GPT_NEOX_CONFIG, **change}, gpt_neox["tensors"])
    if said:
        (folder / "model.safetensors").unlink()
    out = tmp_path / "out"
    out.mkdir()
    code, _, err = run(capsys, "import", gpt_neox["spec"], folder, "-o", out / "w.npz", *flags(GPT_NEOX_SET))
    assert code == (1 if said else 0), err
    for words in said:
        assert words in err, err
    assert [p.name for p in out.iterdir()] == ([] if said else ["w.npz"])


@pytest.mark.parametrize(
    ("spec", "folder", "said"),
    [
        # The spec's first block opens a residual whose first layer is no `branch`.
        (
            "llama",
            "gpt_neox",
            [
                "error[C002]: the spec is not built like a GPT-NeoX: a `branch` should come here, not `rmsnorm` "
                "`layers.0.attn_norm`",
                "= note: a GPT-NeoX is embed, then blocks of residual { branch { layernorm, attention } branch { "
                "layernorm, linear, gelu, linear } }, then layernorm, linear (dropout anywhere)",
            ],
        ),
        # ... and a GPT-NeoX spec is not a Llama: the diagnostic points at the `branch`.
        (
            "gpt_neox",
            "llama",
            [
                f"gpt_neox_f32.par:{FIRST_BRANCH_LINE}:5: error[C002]",
                "error[C002]: the spec is not built like a Llama: `rmsnorm` should come here, not a `branch`",
            ],
        ),
    ],
)
def test_a_spec_is_matched_to_a_family_by_its_residuals_and_branches(
    spec: str,
    folder: str,
    said: list[str],
    gpt_neox: dict[str, Any],
    llama: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    cases = {"gpt_neox": (gpt_neox, GPT_NEOX_SET), "llama": (llama, LLAMA_SET)}
    (spec_case, sizes), (checkpoint, _) = cases[spec], cases[folder]
    code, _, err = run(
        capsys, "import", spec_case["spec"], checkpoint["folder"], "-o", tmp_path / "w.npz", *flags(sizes)
    )
    assert code == 1 and not (tmp_path / "w.npz").exists()
    for words in said:
        assert words in err, err


def test_a_tensor_map_with_heads_interleaves_its_parts_head_by_head() -> None:
    """GPT-NeoX's `query_key_value` rows, [heads, 3, head_dim]: q, k and v of head 0, then of
    head 1; `join` puts back what `split` takes apart."""
    from dslc.interop.mapping import TensorMap

    fused = TensorMap("qkv", ("q", "k", "v"), heads=2)
    rows = np.arange(2 * 12).reshape(2, 12)  # [in, 2 heads x 3 parts x head_dim 2]
    q, k, v = fused.split(rows, [4, 4, 4])
    assert q[0].tolist() == [0, 1, 6, 7] and k[0].tolist() == [2, 3, 8, 9] and v[1].tolist() == [16, 17, 22, 23]
    assert np.array_equal(fused.join([q, k, v]), rows)
    blocks = TensorMap("qkv", ("q", "k", "v"))
    assert blocks.split(rows, [4, 4, 4])[0][0].tolist() == [0, 1, 2, 3]


def test_a_tensor_map_with_axes_turns_a_conv2d_kernel_into_the_spec_s() -> None:
    """A Conv2d's kernel [out, in, height, width] holds at [o, i, y, x] what the spec's conv
    kernel [height, width, in, out] holds at [y, x, i, o]: its axes taken in another order,
    not reversed (a reversal would swap the window's height and width)."""
    from dslc.interop.mapping import TensorMap
    from dslc.interop.vit import CONV_AXES

    conv = TensorMap("projection.weight", ("patches.kernel",), axes=CONV_AXES)
    spec = np.arange(2 * 3 * 4 * 5).reshape(2, 3, 4, 5)  # [height 2, width 3, in 4, out 5]
    stored = conv.to_checkpoint(spec)
    assert stored.shape == conv.stored_shape(spec.shape) == (5, 4, 2, 3)
    assert stored[4, 1, 0, 2] == spec[0, 2, 1, 4]
    assert np.array_equal(conv.to_spec(stored), spec)
    token = TensorMap("cls_token", ("cls.token",), ones=2)
    assert token.stored_shape((8,)) == (1, 1, 8) and token.to_spec(np.zeros((1, 1, 8))).shape == (8,)


def test_every_checkpoint_diagnostic_is_documented_and_tested() -> None:
    emitted = {
        code
        for path in (ROOT / "dslc").rglob("*.py")
        for code in re.findall(r"[\"'](C0\d\d)[\"']", path.read_text(encoding="utf-8"))
    }
    documented = set(re.findall(r"^\| (C0\d\d) \|", (ROOT / "docs" / "checkpoints.md").read_text(), flags=re.M))
    tests = (ROOT / "tests" / "interop" / "test_interop.py", ROOT / "tests" / "train" / "test_init_from.py")
    tested = set(re.findall(r"error\[(C0\d\d)\]", "".join(p.read_text() for p in tests)))
    assert emitted and emitted == documented == tested


@pytest.mark.parametrize(
    ("family", "change", "needed", "follows"),
    [
        # specs/gpt2.par declares `const ffn = 4 * d`: `--set d=64` makes the MLP 256 wide too.
        ("gpt2", {"n_embd": 64}, ["--set d=64"], {"n_inner": "`--set d=64` fixes this too"}),
        # specs/gpt_neox.par derives `ffn` and `rope_dims` from `d`: `--set d=64` gives both.
        (
            "gpt_neox",
            {"hidden_size": 64, "intermediate_size": 256},
            ["--set d=64"],
            {"intermediate_size": "`--set d=64` fixes this too", "rotary_pct": "`--set d=64` fixes this too"},
        ),
        # A config that states head_dim = hidden_size / heads: the width's `--set` gives it.
        ("llama", {"hidden_size": 64, "head_dim": 16}, ["--set d=64"], {"head_dim": "`--set d=64` fixes this too"}),
        # ... or the width's and the heads' together, neither alone.
        (
            "llama",
            {"hidden_size": 64, "num_attention_heads": 2, "head_dim": 32},
            ["--set d=64", "--set heads=2"],
            {"head_dim": "`--set d=64 --set heads=2` fix this too"},
        ),
        # 3 layers do not split over the spec's 2 stages: the advice is the same, the `--set`
        # of the layers needed and not named for the head width.
        (
            "llama",
            {"hidden_size": 64, "num_attention_heads": 2, "head_dim": 32, "num_hidden_layers": 3},
            ["--set d=64", "--set heads=2", "--set layers=3"],
            {"head_dim": "`--set d=64 --set heads=2` fix this too"},
        ),
    ],
)
def test_a_mismatch_that_a_suggested_set_fixes_gets_no_advice_of_its_own(
    family: str,
    change: dict[str, object],
    needed: list[str],
    follows: dict[str, str],
    llama: dict[str, Any],
    gpt_neox: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    """Each mismatch is still reported, but only the `--set`s that are needed are suggested:
    one that follows from them says so instead of asking for a `--set` or an edit of its own."""
    spec, config, sizes = {
        "gpt2": (GPT2, GPT2_CONFIG, GPT2_SET),
        "llama": (llama["spec"], LLAMA_CONFIG, LLAMA_SET),
        "gpt_neox": (gpt_neox["spec"], GPT_NEOX_CONFIG, GPT_NEOX_SET),
    }[family]
    given = {k: v for k, v in sizes.items() if k != "d"}
    folder = write_checkpoint(tmp_path / "checkpoint", {**config, **change}, {})  # no tensors: config first
    code, _, err = run(capsys, "import", spec, folder, "-o", tmp_path / "w.npz", *flags(given))
    assert code == 1, err
    assert sorted(re.findall(r"= help: (.*)", err)) == sorted(needed), err
    for key, note in follows.items():
        report = next(part for part in re.split(r"\n(?=\S)", err) if f"config.json's `{key}`" in part)
        assert f"= note: {note}" in report and "= help" not in report, err
    # With the suggested `--set`s, the config fits and import goes on to the tensors (none here).
    sets = [part for fix in needed for part in fix.split(" ", 1)]
    argv = ["import", spec, folder, "-o", tmp_path / "w.npz", "--mesh", "1x1x1", *flags(given), *sets]
    code, _, err = run(capsys, *argv)
    assert code == 1 and "C001" not in err and "tensors of the spec missing" in err, err


@pytest.mark.parametrize(
    ("family", "change", "dtype", "exported"),
    [
        # Every field is the original's: the spec states the same sizes, and GPT-2's n_ctx follows n_positions.
        ("gpt2", {"n_ctx": 32, "_name_or_path": "tiny-gpt2", "use_cache": True}, None, {"tie_word_embeddings": True}),
        # A model that goes longer than the spec's 16 tokens still does; the dtype is the export's.
        (
            "llama",
            {"max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2, "dtype": "float32"},
            "bf16",
            {"head_dim": 8, "torch_dtype": "bfloat16", "dtype": "bfloat16"},
        ),
        # One that goes shorter is exported as long as the spec runs it.
        (
            "llama",
            {"max_position_embeddings": 8, "pad_token_id": 0},
            None,
            {"head_dim": 8, "max_position_embeddings": 16},
        ),
        # transformers 5's `rope_parameters`, which import reads first, is kept; a later
        # transformers 4's second names for the rotary base and share are kept too, stating
        # the spec's whatever they said; so is Pythia's context of 2048.
        (
            "gpt_neox",
            {
                "rope_parameters": ROPE_PARAMETERS,
                "rope_theta": 5000,
                "partial_rotary_factor": 0.5,
                "max_position_embeddings": 2048,
                "_name_or_path": "tiny-pythia",
            },
            None,
            {"attention_bias": True, "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        ),
        # Gemma 2's 8192 positions and transformers 5's `rope_parameters`; the alternation the
        # spec computes is stated as `layer_types`, which transformers 5 writes too.
        (
            "gemma2",
            {
                "max_position_embeddings": 8192,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                "_name_or_path": "tiny-gemma-2",
            },
            "bf16",
            {"torch_dtype": "bfloat16", "layer_types": ["sliding_attention", "full_attention"] * 2},
        ),
        # The labels' names (the dataset's: the spec knows only how many), the sizes as the
        # original wrote them, a `num_labels` beside `id2label`.
        (
            "vit",
            {"image_size": [16, 16], "patch_size": [4, 4], "num_labels": 10, "_name_or_path": "tiny-vit"},
            None,
            {},
        ),
    ],
)
def test_export_keeps_what_the_imported_config_said(
    family: str,
    change: dict[str, object],
    dtype: str | None,
    exported: dict[str, object],
    gpt2: dict[str, Any],
    llama: dict[str, Any],
    gpt_neox: dict[str, Any],
    gemma2: dict[str, Any],
    vit: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    """Import keeps the checkpoint's config.json with the weights, and export writes its fields
    again (token ids, a longer context, names): only what the spec determines comes from it."""
    case, spec, sizes, config = {
        "gpt2": (gpt2, GPT2, GPT2_SET, GPT2_CONFIG),
        "llama": (llama, llama["spec"], LLAMA_SET, LLAMA_CONFIG),
        "gpt_neox": (gpt_neox, gpt_neox["spec"], GPT_NEOX_SET, GPT_NEOX_CONFIG),
        "gemma2": (gemma2, gemma2["spec"], GEMMA2_SET, GEMMA2_CONFIG),
        "vit": (vit, vit["spec"], VIT_SET, VIT_CONFIG),
    }[family]
    config = {**config, **change}
    folder = write_checkpoint(tmp_path / "checkpoint", config, case["tensors"])
    weights = tmp_path / "w.npz"
    code, _, err = run(capsys, "import", spec, folder, "-o", weights, *flags(sizes))
    assert code == 0, err
    with np.load(weights) as kept, np.load(case["weights"]) as plain:
        assert sorted(kept.files) == sorted(plain.files)  # the weights alone, to every reader
    dtype_flags = ["--dtype", dtype] if dtype else []
    code, _, err = run(
        capsys, "export", spec, "--weights", weights, "-o", tmp_path / "out", *dtype_flags, *flags(sizes)
    )
    assert code == 0, err
    assert _exported(tmp_path / "out")[0] == {**config, **exported}
    # Weights saved anew keep no config: the export states the spec's alone, as before.
    with np.load(weights) as kept:
        np.savez(tmp_path / "anew.npz", **{n: kept[n] for n in kept.files})
    code, _, err = run(
        capsys, "export", spec, "--weights", tmp_path / "anew.npz", "-o", tmp_path / "again", *flags(sizes)
    )
    assert code == 0, err
    # (the spec states these itself: its sequence's length, its dtype, its image and patch sizes)
    stated = {"max_position_embeddings", "dtype", "image_size", "patch_size"}
    assert not set(change) - stated & set(_exported(tmp_path / "again")[0])


def test_an_exported_t5_states_its_token_ids_and_keeps_imported_ones(
    t5: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Without decoder_start_token_id transformers' T5 can neither shift labels right nor
    generate: weights with no imported config export T5's own ids (start from the padding id
    0, stop at 1); a checkpoint that said others gets its own back."""
    with np.load(t5["weights"]) as kept:
        np.savez(tmp_path / "anew.npz", **{n: kept[n] for n in kept.files})
    code, _, err = run(
        capsys, "export", t5["spec"], "--weights", tmp_path / "anew.npz", "-o", tmp_path / "a", *flags(T5_SET)
    )
    assert code == 0, err
    fresh = _exported(tmp_path / "a")[0]
    assert {k: fresh[k] for k in ("decoder_start_token_id", "pad_token_id", "eos_token_id")} == {
        "decoder_start_token_id": 0,
        "pad_token_id": 0,
        "eos_token_id": 1,
    }
    own = {**T5_CONFIG, "decoder_start_token_id": 5, "pad_token_id": 5, "eos_token_id": 7}
    folder = write_checkpoint(tmp_path / "checkpoint", own, t5["tensors"])
    code, _, err = run(capsys, "import", t5["spec"], folder, "-o", tmp_path / "w.npz", *flags(T5_SET))
    assert code == 0, err
    code, _, err = run(
        capsys, "export", t5["spec"], "--weights", tmp_path / "w.npz", "-o", tmp_path / "b", *flags(T5_SET)
    )
    assert code == 0, err
    again = _exported(tmp_path / "b")[0]
    assert (again["decoder_start_token_id"], again["pad_token_id"], again["eos_token_id"]) == (5, 5, 7)


def test_a_damaged_kept_config_is_refused_for_export(
    gpt2: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import zipfile

    weights = tmp_path / "w.npz"
    weights.write_bytes(gpt2["weights"].read_bytes())
    with zipfile.ZipFile(weights, "a") as archive:
        archive.comment = b"dslc import: config.json\n{not json"
    out = tmp_path / "out"
    code, printed, err = run(capsys, "export", GPT2, "--weights", weights, "-o", out, *flags(GPT2_SET))
    assert code == 1 and printed == ""
    assert "w.npz: error[C007]: the config.json these weights were imported with, kept in the archive's comment" in err
    assert "import the checkpoint again" in err and "Traceback" not in err
    assert not out.exists()


def test_a_config_too_long_for_the_archive_comment_is_not_kept() -> None:
    from dslc.interop.remembered import LIMIT, MARK, comment_for

    assert comment_for(GPT2_CONFIG).startswith(MARK) and len(comment_for(GPT2_CONFIG)) < 1000
    assert comment_for({**GPT2_CONFIG, "id2label": {str(i): "x" * 8 for i in range(LIMIT // 8)}}) == b""


def test_a_qwen3_moe_config_that_does_not_renormalise_says_so(
    qwen3_moe: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """norm_topk_prob false (transformers' default) against the spec's `normalize = true`: C001
    with `--set normalize=false`; with it, the import fits and computes the reference."""
    config = {**QWEN3_MOE_CONFIG, "norm_topk_prob": False}
    tensors = qwen3_moe_tensors(config, seed=7)
    folder = write_checkpoint(tmp_path / "unnormalised", config, tensors)
    spec = qwen3_moe["spec"]
    code, _, err = run(capsys, "import", spec, folder, "-o", tmp_path / "w.npz", *flags(QWEN3_MOE_SET))
    assert code != 0 and "norm_topk_prob" in err and "--set normalize=false" in err
    sizes = {**QWEN3_MOE_SET, "normalize": "false"}
    code, _, err = run(capsys, "import", spec, folder, "-o", tmp_path / "w.npz", *flags(sizes))
    assert code == 0, err
    inputs = batch(96, seed=8)
    got = logits_of(capsys, spec, tmp_path / "w.npz", inputs, sizes, "1x1x1", tmp_path)
    want = llama_logits(config, tensors, inputs["tokens"])
    assert relative_error(got, want) <= TOLERANCE
    assert relative_error(llama_logits(QWEN3_MOE_CONFIG, tensors, inputs["tokens"]), want) > 1e-3


WINDOW_LINE = declared_at("window", "gemma2")
ALTERNATING = ["sliding_attention", "full_attention"] * 2


@pytest.mark.parametrize(
    ("change", "said"),
    [
        # transformers 5 states the alternation and keeps the rotary base in `rope_parameters`.
        ({"layer_types": ALTERNATING, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, []),
        (
            {"sliding_window": 8},
            [
                f"gemma2_f32.par:{WINDOW_LINE}:1: error[C001]: config.json's `sliding_window` is 8, but the spec's "
                "sliding window is 4",
                "used by `layers.0.local.attn`",
                "= note: 2 layers of the spec disagree with it",
                "= help: --set window=8",
            ],
        ),
        (
            {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
            ["`attn_logit_softcapping` is 50.0", "--set attn_cap=50.0", "--set logit_cap=30.0"],
        ),
        # No value of `attn_cap` is none: the diagnostic says what to edit instead.
        (
            {"attn_logit_softcapping": None},
            [
                "`attn_logit_softcapping` is null, but the spec's cap on attention scores is 2.0",
                "leave out the attention's `softcap`",
            ],
        ),
        (
            {"head_dim": 8, "query_pre_attn_scalar": 8},
            ["`head_dim` is 8, but the spec's head width is 16", "--set head_dim=8"],
        ),
        (
            {"tie_word_embeddings": False},
            ["`tie_word_embeddings` is false", "give the head a kernel of its own: drop its `tie`"],
        ),
        # Gemma-2-27B scales its heads of 128 by 1/sqrt(144): the spec's attention says so with `scale`.
        (
            {"query_pre_attn_scalar": 12},
            [
                "config.json's `query_pre_attn_scalar` is 12, but the spec's query scalar (its scores scaled by "
                "1/sqrt of it) is 16",
                f"write `scale={12**-0.5!r}` on the attention layers",
            ],
        ),
        ({"hidden_activation": "gelu"}, ["error[C003]: hidden_activation 'gelu'"]),
        (
            {"layer_types": ["full_attention", "sliding_attention"] * 2},
            ["error[C003]: layer_types is not Gemma 2's alternation", "layer 0 is 'full_attention'"],
        ),
        ({"final_logit_softcapping": None}, ["error[C003]: final_logit_softcapping is null"]),
        ({"use_bidirectional_attention": True}, ["error[C003]: use_bidirectional_attention is true"]),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, ["error[C003]: rope type 'linear'"]),
    ],
)
def test_a_gemma2_config_is_checked_before_a_tensor_is_read(
    change: dict[str, object],
    said: list[str],
    gemma2: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    folder = write_checkpoint(tmp_path / "checkpoint", {**GEMMA2_CONFIG, **change}, gemma2["tensors"])
    if said:
        (folder / "model.safetensors").unlink()
    code, _, err = run(capsys, "import", gemma2["spec"], folder, "-o", tmp_path / "w.npz", *flags(GEMMA2_SET))
    assert code == (1 if said else 0), err
    for words in said:
        assert words in err, err
    assert (tmp_path / "w.npz").exists() == (not said)


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (
            ("offset=true", "offset=false"),
            ["error[C002]: the spec is not built like a Gemma 2: its norms store their scale as an offset from 1"],
        ),
        (("scale=true", "scale=false"), ["its embedding is scaled by sqrt(d)", "write `scale=true`"]),
        (("activation=gelu", "activation=silu"), ["its MLP gates with the tanh GELU (GeGLU)"]),
        # The global layer with the local one's window, and the local one without.
        (
            ("rope_base=rope_base, softcap=attn_cap)", "rope_base=rope_base, window=window, softcap=attn_cap)"),
            ["its odd layers (1, 3, ...) attend to every earlier token", "leave out `window` on the attention"],
        ),
        (
            ("rope_base=rope_base, window=window, softcap", "rope_base=rope_base, softcap"),
            ["its even layers (0, 2, ...) attend within a sliding window"],
        ),
        # Without the cap on the logits the spec is another family's shape.
        (
            ("  softcap(logit_cap)\n", ""),
            ["error[C002]: the spec is not built like a Gemma 2: `softcap` should come here, not the end of `forward`"],
        ),
    ],
)
def test_a_spec_that_does_not_compute_gemma2_is_refused(
    edit: tuple[str, str],
    said: list[str],
    gemma2: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    text = Path(gemma2["spec"]).read_text()
    assert edit[0] in text
    spec = tmp_path / "edited.par"
    spec.write_text(text.replace(edit[0], edit[1]))
    code, _, err = run(capsys, "import", spec, gemma2["folder"], "-o", tmp_path / "w.npz", *flags(GEMMA2_SET))
    assert code == 1 and not (tmp_path / "w.npz").exists(), err
    for words in said:
        assert words in err, err
    # Export asks the same of the spec.
    code, _, err = run(
        capsys, "export", spec, "--weights", gemma2["weights"], "-o", tmp_path / "out", *flags(GEMMA2_SET)
    )
    assert code == 1 and said[0] in err and not (tmp_path / "out").exists(), err


SIDE_LINE = declared_at("side", "vit")


@pytest.mark.parametrize(
    ("change", "said"),
    [
        # transformers reads [height, width] as it reads one side of a square.
        ({"image_size": [16, 16], "patch_size": [4, 4]}, []),
        (
            {"image_size": 32},
            [
                f"vit.par:{SIDE_LINE}:1: error[C001]: config.json's `image_size` is 32, but the spec's image height "
                "is 16",
                "used by `patches`",
                "= help: --set side=32",
            ],
        ),
        # No constant makes the spec's square images another shape: the diagnostic says what to edit.
        (
            {"image_size": [16, 12]},
            [
                "`image_size` is [16, 12] (width 12), but the spec's image width is 16",
                "make the images input [batch, 16, 12, channels]",
            ],
        ),
        ({"patch_size": 8}, ["`patch_size` is 8, but the spec's patch size (the conv's kernel) is 4", "--set patch=8"]),
        (
            {"num_channels": 1},
            ["`num_channels` is 1, but the spec's number of image channels is 3", "--set channels=1"],
        ),
        ({"layer_norm_eps": 1e-6}, ["`layer_norm_eps` is 1e-06", "--set eps=1e-06"]),
        (
            {"id2label": {"0": "cat", "1": "dog"}, "label2id": {"cat": 0, "dog": 1}},
            ["`id2label` is 2 labels, but the spec's number of classes", "--set classes=2"],
        ),
        # transformers' default is two labels, which save_pretrained leaves out.
        ({"id2label": None, "label2id": None, "num_labels": 3}, ["`num_labels` is 3", "--set classes=3"]),
        ({"id2label": {}, "label2id": {}}, ["error[C003]: no labels", "id2label is empty"]),
        (
            {"hidden_act": "gelu_new"},
            ['`hidden_act` is "gelu_new", but the spec\'s GELU is "gelu"', "`gelu()` for gelu_new"],
        ),
        ({"hidden_act": "relu"}, ["error[C003]: hidden_act 'relu' is not one dslc computes"]),
        ({"qkv_bias": False}, ["error[C003]: qkv_bias is false: dslc's attention adds a bias to o only where"]),
        (
            {"architectures": ["ViTModel"]},
            ["error[C003]: architectures ['ViTModel']: dslc maps ViTForImageClassification"],
        ),
        ({"patch_size": [4, 2]}, ["error[C003]: patch_size [4, 2]: dslc's conv windows are square"]),
        (
            {"image_size": 18},
            ["error[C003]: image_size 18 is not a multiple of patch_size 4", "--set side=18"],
        ),
        ({"image_size": [16]}, ["error[C004]: 1 unusable value", "`image_size`: value error, should be a positive"]),
    ],
)
def test_a_vit_config_is_checked_before_a_tensor_is_read(
    change: dict[str, object],
    said: list[str],
    vit: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    config = {k: v for k, v in {**VIT_CONFIG, **change}.items() if v is not None}
    folder = write_checkpoint(tmp_path / "checkpoint", config, vit["tensors"])
    if said:
        (folder / "model.safetensors").unlink()
    code, _, err = run(capsys, "import", vit["spec"], folder, "-o", tmp_path / "w.npz", *flags(VIT_SET))
    assert code == (1 if said else 0), err
    for words in said:
        assert words in err, err
    assert "Traceback" not in err and (tmp_path / "w.npz").exists() == (not said)


ATTENTION = (
    "attn: attention(d, heads, causal=false, bias=true) shard q[_, model], q_bias[model], k[_, model], "
    "k_bias[model], v[_, model], v_bias[model], o[model, _]"
)


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (
            ("causal=false", "causal=true"),
            ["error[C002]: the spec is not built like a ViT: its attention looks both ways", "write `causal=false`"],
        ),
        # Biases on q, k and v alone: ViT's output projection has one too.
        (
            (ATTENTION, ATTENTION.replace("bias=true", "qkv_bias=true")),
            ["its attention adds biases to q, k, v and o", "write `bias=true` on the attention"],
        ),
        (
            ("pool(mode=first)", "pool(mode=mean)"),
            ["its classifier reads the class token's vector", "write `pool(mode=first)`"],
        ),
        (
            ("position_embed(side // patch * (side // patch) + 1, d)", "position_embed(64, d)"),
            ["its position table holds one row for each patch and one for the class token (17 here)"],
        ),
        (
            ("  cls: class_token(d)\n", ""),
            [
                "error[C002]: the spec is not built like a ViT: `class_token` should come here, not `position_embed`",
                "a ViT is conv, flatten, class_token, position_embed, then blocks of residual { layernorm, attention }",
            ],
        ),
    ],
)
def test_a_spec_that_does_not_compute_vit_is_refused(
    edit: tuple[str, str],
    said: list[str],
    vit: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    text = VIT.read_text()
    assert edit[0] in text
    spec = tmp_path / "edited.par"
    spec.write_text(text.replace(edit[0], edit[1]))
    code, _, err = run(capsys, "import", spec, vit["folder"], "-o", tmp_path / "w.npz", *flags(VIT_SET))
    assert code == 1 and not (tmp_path / "w.npz").exists(), err
    for words in said:
        assert words in err, err
    # Export asks the same of the spec.
    code, _, err = run(capsys, "export", spec, "--weights", vit["weights"], "-o", tmp_path / "out", *flags(VIT_SET))
    assert code == 1 and said[0] in err and not (tmp_path / "out").exists(), err


def test_a_vit_kernel_in_another_layout_is_named(
    vit: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A patch kernel stored [height, width, in, out] (as a checkpoint converted from another
    framework might hold it) is not read as transformers' [out, in, height, width]."""
    name = "vit.embeddings.patch_embeddings.projection.weight"
    tensors = {**vit["tensors"], name: vit["tensors"][name].transpose(2, 3, 1, 0)}
    folder = write_checkpoint(tmp_path / "turned", VIT_CONFIG, tensors)
    code, _, err = run(capsys, "import", vit["spec"], folder, "-o", tmp_path / "w.npz", *flags(VIT_SET))
    assert code == 1 and not (tmp_path / "w.npz").exists(), err
    assert f"error[C006]: `{name}` is [4, 4, 3, 32], the spec needs [32, 3, 4, 4]" in err


def test_sharded_and_unprefixed_vit_checkpoints_import_alike(
    vit: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The classifier sits beside `vit.`: a checkpoint in shards, or whose other tensors are
    named without `vit.`, gives the same weights."""
    sharded = write_checkpoint(tmp_path / "sharded", VIT_CONFIG, vit["tensors"], shards=3)
    bare = {name.removeprefix("vit."): t for name, t in vit["tensors"].items()}
    assert "classifier.bias" in bare and "embeddings.cls_token" in bare
    unprefixed = write_checkpoint(tmp_path / "bare", VIT_CONFIG, bare)
    with np.load(vit["weights"]) as want:
        for folder in (sharded, unprefixed):
            code, _, err = run(capsys, "import", VIT, folder, "-o", tmp_path / "w.npz", *flags(VIT_SET))
            assert code == 0, err
            with np.load(tmp_path / "w.npz") as got:
                assert sorted(got.files) == sorted(want.files)
                assert all(np.array_equal(got[n], want[n]) for n in want.files)


# ---- T5 -------------------------------------------------------------------------------------------


def _t5_checkpoint(folder: Path, change: dict[str, object], tensors: dict[str, np.ndarray]) -> Path:
    """T5_CONFIG changed (a key given None is left out), written with `tensors`."""
    config = {k: v for k, v in {**T5_CONFIG, **change}.items() if v is not None}
    return write_checkpoint(folder, config, tensors)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        # transformers reads a missing num_decoder_layers as num_layers, and T5WithLMHeadModel
        # is its older name for T5ForConditionalGeneration.
        ({"num_decoder_layers": None, "architectures": ["T5WithLMHeadModel"]}, []),
        (
            {"d_model": 64},
            [
                f"t5_f32.par:{declared_at('d', 't5')}:1: error[C001]: config.json's `d_model` is 64, but the spec's "
                "width is 32",
                "= help: --set d=64",
            ],
        ),
        ({"d_kv": 8}, ["`d_kv` is 8, but the spec's head width is 16", "= help: --set head_dim=8"]),
        (
            {"relative_attention_num_buckets": 32, "relative_attention_max_distance": 128},
            ["= help: --set buckets=32", "= help: --set max_distance=128", "2 layers of the spec disagree with it"],
        ),
        ({"num_layers": 3, "num_decoder_layers": 3}, ["= help: --set layers=3"]),
        # One constant holds both depths: a decoder deeper than its encoder is an edit of the spec.
        (
            {"num_decoder_layers": 3},
            ["`num_decoder_layers` is 3, but the spec's number of decoder blocks is 2", "repeat the decoder's block 3"],
        ),
        ({"layer_norm_epsilon": 1e-5}, ["`layer_norm_epsilon` is 1e-05", "--set eps=1e-05"]),
        (
            {"feed_forward_proj": "gated-silu", "dense_act_fn": "silu"},
            [
                "error[C001]: config.json's `feed_forward_proj` is \"gated-silu\" (silu), but the spec's MLP's gate "
                'activation is "gelu"',
                "write `activation=silu` on the swiglu",
            ],
        ),
        (
            {"tie_word_embeddings": True},
            ["error[C003]: tie_word_embeddings is true: transformers then scales the decoder's output by d_model"],
        ),
        (
            {"feed_forward_proj": "relu", "dense_act_fn": "relu", "is_gated_act": False},
            ["error[C003]: feed_forward_proj 'relu': the original T5's MLP, not gated", "gelu_new(x wi_0) * (x wi_1)"],
        ),
        (
            {"feed_forward_proj": "gated-relu", "dense_act_fn": "relu"},
            ["error[C003]: feed_forward_proj 'gated-relu': a gate dslc does not compute"],
        ),
        (
            {"dense_act_fn": "relu"},
            ["error[C003]: dense_act_fn 'relu' contradicts feed_forward_proj 'gated-gelu', which makes it 'gelu_new'"],
        ),
        (
            {"architectures": ["T5EncoderModel"]},
            ["error[C003]: architectures ['T5EncoderModel']: dslc maps T5ForConditionalGeneration"],
        ),
        ({"is_encoder_decoder": False}, ["error[C003]: is_encoder_decoder is false"]),
        (
            {"feed_forward_proj": "gelu-gated"},
            ["error[C004]: 1 unusable value", "`feed_forward_proj`: value error, should be an activation's name"],
        ),
    ],
)
def test_a_t5_config_is_checked_before_a_tensor_is_read(
    change: dict[str, object],
    said: list[str],
    t5: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    folder = _t5_checkpoint(tmp_path / "checkpoint", change, t5["tensors"])
    if said:
        (folder / "model.safetensors").unlink()
    code, _, err = run(capsys, "import", t5["spec"], folder, "-o", tmp_path / "w.npz", *flags(T5_SET))
    assert code == (1 if said else 0), err
    for words in said:
        assert words in err, err
    assert "Traceback" not in err and (tmp_path / "w.npz").exists() == (not said)


ENCODER_ATTENTION = "causal=false, scale=1.0, position_bias=encoder_bias)"
DECODER_BIAS = "  stream decoder_bias(decoder_tokens) {"


@pytest.mark.parametrize(
    ("edits", "said"),
    [
        (
            [(ENCODER_ATTENTION, "causal=false, position_bias=encoder_bias)")],
            [
                "error[C002]: the spec is not built like a T5: its encoder's attention does not scale its scores",
                "= help: write `scale=1.0`",
            ],
        ),
        (
            [("scale=1.0, position_bias=decoder_bias)", "scale=1.0)")],
            [
                "error[C002]: the spec is not built like a T5: `layers.0.self_attn.attn` reads the decoder's relative "
                "position bias (`position_bias=`, a stream)"
            ],
        ),
        (
            [("max_distance=max_distance, bidirectional=false)", "max_distance=max_distance)")],
            ["its decoder's position buckets are of earlier keys only", "write `bidirectional=false`"],
        ),
        (
            [("embed: embed(vocab, d) tie table = encoded.embed.table", "embed: embed(vocab, d)")],
            [
                "its decoder embeds its tokens with the encoder's table (`encoded.embed.table`)",
                "write `tie table = encoded.embed.table` on the decoder's embedding",
            ],
        ),
        # Cross-attention over a stream that is no encoder.
        (
            [
                ("memory=encoded)", "memory=other)"),
                (DECODER_BIAS, "  stream other(tokens) {\n    embed: embed(vocab, d)\n  }\n" + DECODER_BIAS),
            ],
            [
                "error[C002]: the spec is not built like a T5: a residual branch should come here, not the end of the "
                "stream `other`",
                "= note: a T5's encoder (the stream its cross-attention reads) is embed, then blocks of residual {",
            ],
        ),
        # A stream no T5 layer reads.
        (
            [(DECODER_BIAS, "  stream other(tokens) {\n    embed: embed(vocab, d)\n  }\n" + DECODER_BIAS)],
            ["the stream `other` is none of a T5's (its encoder, and each stack's position bias)"],
        ),
    ],
)
def test_a_spec_that_does_not_compute_t5_is_refused(
    edits: list[tuple[str, str]],
    said: list[str],
    t5: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    text = Path(t5["spec"]).read_text()
    for old, new in edits:
        assert old in text
        text = text.replace(old, new)
    spec = tmp_path / "edited.par"
    spec.write_text(text)
    code, _, err = run(capsys, "import", spec, t5["folder"], "-o", tmp_path / "w.npz", *flags(T5_SET))
    assert code == 1 and not (tmp_path / "w.npz").exists(), err
    for words in said:
        assert words in err, err
    # Export asks the same of the spec.
    code, _, err = run(capsys, "export", spec, "--weights", t5["weights"], "-o", tmp_path / "out", *flags(T5_SET))
    assert code == 1 and said[0] in err and not (tmp_path / "out").exists(), err


@pytest.mark.parametrize("written", ["softcap=30.0", "window=8"])
def test_a_gpt2_whose_attention_caps_or_windows_its_scores_is_refused(
    written: str, gpt2: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A GPT-2's attention neither caps its scores nor looks through a window: the weights
    would import and compute other logits, so the spec is not built like a GPT-2 (one table of
    such arguments, `ATTENTION_ARGUMENTS`, for every family; GPT-2's requirements never
    listed these)."""
    text = GPT2.read_text()
    call = "attention(d, heads, bias=true)"
    assert call in text
    spec = tmp_path / "gpt2.par"
    spec.write_text(text.replace(call, call[:-1] + f", {written})"))
    name = written.split("=")[0]
    code, _, err = run(capsys, "import", spec, gpt2["folder"], "-o", tmp_path / "w.npz", *flags(GPT2_SET))
    assert code == 1 and "error[C002]: the spec is not built like a GPT-2" in err, err
    assert f"= help: leave out `{name}`" in err and not (tmp_path / "w.npz").exists(), err


def test_no_other_family_takes_attention_it_does_not_map(
    llama: dict[str, Any], t5: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A Llama spec whose attention does not scale its scores as a Llama's does (T5's
    `scale=1.0`) would import the weights and compute other logits: it is not built like a
    Llama, for import and export alike. And a Llama checkpoint is not a T5's: specs/t5.par's
    streams are out of place in a Llama."""
    text = Path(llama["spec"]).read_text()
    written = "rope=true, rope_base=rope_base, qkv_bias=qkv_bias)"
    assert written in text
    spec = tmp_path / "unscaled.par"
    spec.write_text(text.replace(written, written[:-1] + ", scale=1.0)"))
    said = [
        "error[C002]: the spec is not built like a Llama: its attention scales its scores by 1/sqrt(head_dim)",
        "= help: leave out `scale`",
    ]
    code, _, err = run(capsys, "import", spec, llama["folder"], "-o", tmp_path / "w.npz", *flags(LLAMA_SET))
    assert code == 1 and all(words in err for words in said), err
    code, _, err = run(capsys, "export", spec, "--weights", llama["weights"], "-o", tmp_path / "out", *flags(LLAMA_SET))
    assert code == 1 and said[0] in err and not (tmp_path / "out").exists(), err
    # The default scale written out is the default: 1/sqrt(8) for heads of 8.
    spec.write_text(text.replace(written, written[:-1] + f", scale={8**-0.5!r})"))
    code, _, err = run(capsys, "import", spec, llama["folder"], "-o", tmp_path / "w.npz", *flags(LLAMA_SET))
    assert code == 0, err
    code, _, err = run(capsys, "import", t5["spec"], llama["folder"], "-o", tmp_path / "t5.npz", *flags(T5_SET))
    assert code == 1 and not (tmp_path / "t5.npz").exists(), err
    assert (
        "error[C002]: the spec is not built like a Llama: `embed` should come here, not the stream `encoder_bias`"
        in err
    )


def test_t5_s_token_table_is_read_under_any_of_its_names(
    t5: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """transformers ties `encoder.embed_tokens` and `decoder.embed_tokens` to `shared`: a
    checkpoint may store them too (the same tensor), or only them; one where they differ is
    refused. The first cross-attention's bias table older checkpoints carry, which
    transformers never reads, is ignored; shards change nothing."""
    tensors, shared = t5["tensors"], t5["tensors"]["shared.weight"]
    embeds = {"encoder.embed_tokens.weight": shared, "decoder.embed_tokens.weight": shared}
    unread = {"decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight": np.ones((8, 4), np.float32)}
    without = {n: t for n, t in tensors.items() if n != "shared.weight"}
    with np.load(t5["weights"]) as want:
        for name, stored, shards in (
            ("all three names", {**tensors, **embeds, **unread}, 1),
            ("the encoder's only", {**without, "encoder.embed_tokens.weight": shared}, 3),
        ):
            folder = write_checkpoint(tmp_path / name.replace(" ", "_"), T5_CONFIG, stored, shards=shards)
            code, _, err = run(capsys, "import", t5["spec"], folder, "-o", tmp_path / "w.npz", *flags(T5_SET))
            assert code == 0, (name, err)
            with np.load(tmp_path / "w.npz") as got:
                assert sorted(got.files) == sorted(want.files)
                assert all(np.array_equal(got[n], want[n]) for n in want.files), name
    folder = _t5_checkpoint(tmp_path / "differs", {}, {**tensors, **embeds, "decoder.embed_tokens.weight": shared + 1})
    out = tmp_path / "out"
    out.mkdir()
    code, _, err = run(capsys, "import", t5["spec"], folder, "-o", out / "w.npz", *flags(T5_SET))
    assert code == 1 and list(out.iterdir()) == [], err
    assert (
        "model.safetensors: error[C006]: `decoder.embed_tokens.weight` differs from `shared.weight`: transformers "
        "ties them, one tensor under both names"
    ) in err
