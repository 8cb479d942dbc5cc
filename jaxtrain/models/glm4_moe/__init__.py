"""The GLM-4.5 family, in one folder: the decoder composed of Llama's attention, DeepSeek-V3's MoE and the ``moe``
family's stack (``model.py``: ``model.name=glm4_moe``) and its Hugging Face adapter (``hf.py``: ``glm4_moe``).
Importing the package registers both; the decoder's names are re-exported here."""

from jaxtrain.models.glm4_moe import hf
from jaxtrain.models.glm4_moe.model import Block, Glm4Moe, defaults, validate

__all__ = ["Block", "Glm4Moe", "defaults", "hf", "validate"]
