"""Hugging Face checkpoints in and out: `dslc import` and `dslc export`.

A checkpoint folder (config.json and safetensors files) of the GPT-2, Llama, GPT-NeoX, Gemma 2,
ViT or T5 family (Mistral and Qwen2 are Llama with options, Mixtral, Qwen3-MoE and Qwen2-MoE Llamas
with mixtures of experts; Pythia is GPT-NeoX; ViT is ViTForImageClassification; T5 is
T5ForConditionalGeneration, T5 v1.1 and Flan-T5) is mapped onto a spec's weights by the order
of its layers (an encoder-decoder's streams each on its own), its config checked against the
spec first. This
package reads only the checked IR and the spec's text; it imports no jax.
"""

from dslc.interop.convert import Exported, Imported, export_checkpoint, import_checkpoint, plan_import, recognise
from dslc.interop.errors import CheckpointError

__all__ = [
    "CheckpointError",
    "Exported",
    "Imported",
    "export_checkpoint",
    "import_checkpoint",
    "plan_import",
    "recognise",
]
