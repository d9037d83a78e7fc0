"""The two remote-code files of an exported ConceptMoE directory (issue 11 A), and their ``auto_map``.

``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` imports these files from
DIR. They are subclasses of ``conceptmoe.interop.hf_model``'s classes, so the model code stays the
package's own and the ``conceptmoe`` package must be installed where DIR is loaded.
``ConceptMoEForCausalLM.save_pretrained`` writes them into every directory it saves, so a saved
model is as self-contained as an exported one. No transformers import here.
"""

from __future__ import annotations

from pathlib import Path

REMOTE_FILES = {
    "configuration_conceptmoe.py": '''"""ConceptMoE config for transformers' trust_remote_code loading.

The model code is the ``conceptmoe`` package's own: it must be installed (pip install conceptmoe).
"""

from conceptmoe.interop.hf_model import ConceptMoEConfig as _ConceptMoEConfig


class ConceptMoEConfig(_ConceptMoEConfig):
    pass
''',
    "modeling_conceptmoe.py": '''"""ConceptMoE causal LM for transformers' trust_remote_code loading.

The model code is the ``conceptmoe`` package's own: it must be installed (pip install conceptmoe).
"""

from conceptmoe.interop.hf_model import ConceptMoEForCausalLM as _ConceptMoEForCausalLM

from .configuration_conceptmoe import ConceptMoEConfig


class ConceptMoEForCausalLM(_ConceptMoEForCausalLM):
    config_class = ConceptMoEConfig
''',
}
AUTO_MAP = {"AutoConfig": "configuration_conceptmoe.ConceptMoEConfig",
            "AutoModelForCausalLM": "modeling_conceptmoe.ConceptMoEForCausalLM"}


def write_remote_code(out: str | Path) -> None:
    for name, text in REMOTE_FILES.items():
        (Path(out) / name).write_text(text)
