"""Small HF fast tokenizers for random-initialized tiny checkpoints.

A tiny model YAML (``configs/models/tiny_qwen3.yaml``) may carry a
``tokenizer:`` section; ``megarl init-checkpoint`` then writes a real
Hugging Face fast tokenizer (built with the ``tokenizers`` library) next to the
weights, with a chat template and a ``generation_config.json``, so that the
tiny checkpoint is used exactly like a downloaded Qwen3 one: text prompts go
through ``AutoTokenizer`` and its chat template, generation stops at the EOS
ids of the generation config, rewards read decoded text.

The tokenizer is character level: every character of ``chars`` is one token,
every entry of ``words`` (e.g. the role names of the chat template) is one
token, ``special`` tokens are special (skipped when decoding for rewards).
Ids are assigned in that order: special, words, characters, then ``unk``.

Section fields::

    chars: "0123456789\\n"                 # one token per character
    words: [user, assistant, system]       # whole-word tokens (matched before characters)
    special: ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    unk: "<unk>"                           # what characters outside `chars` become
    eos: "<|im_end|>"                      # the tokenizer's eos_token
    pad: "<|endoftext|>"                   # the tokenizer's pad_token
    chat_template: chatml                  # a name in CHAT_TEMPLATES, or a Jinja string
    generation_eos: ["<|im_end|>", "<|endoftext|>"]   # eos_token_id list of generation_config.json
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megarl.errors import ConfigError

#: ChatML as Qwen models use it: ``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`` per message. With ``tools``
#: a system block lists them as JSON; assistant tool calls render as ``<tool_call>`` JSON blocks after the
#: content (``\\n<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``, arguments as the model
#: wrote them), tool results as ``<tool_response>`` blocks inside a user turn.
CHATML = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- 'Tools you may call, one JSON object per call inside <tool_call></tool_call>:\\n<tools>\\n' }}"
    "{%- for tool in tools %}{{- (tool | tojson) + '\\n' }}{%- endfor %}"
    "{{- '</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{%- if message.tool_calls and not message.content %}{{- '<|im_start|>' + message.role }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' }}"
    "{{- fn.arguments if fn.arguments is string else (fn.arguments | tojson) }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CHAT_TEMPLATES: dict[str, str] = {"chatml": CHATML}

_FIELDS = ("chars", "words", "special", "unk", "eos", "pad", "chat_template", "generation_eos")


def _spec(section: Any, where: str) -> dict[str, Any]:
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: 'tokenizer' must be a mapping with fields {list(_FIELDS)}")
    unknown = sorted(set(section) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"{where}: unknown tokenizer fields {unknown}; valid: {list(_FIELDS)}")
    spec = {"chars": "", "words": [], "special": [], "unk": "<unk>", "eos": None, "pad": None,
            "chat_template": "chatml", "generation_eos": None, **section}
    if not spec["chars"]:
        raise ConfigError(f"{where}: tokenizer.chars is empty; list the characters the tokenizer knows")
    tokens = [*spec["special"], *spec["words"], *spec["chars"], spec["unk"]]
    dup = sorted({t for t in tokens if tokens.count(t) > 1})
    if dup:
        raise ConfigError(f"{where}: tokenizer tokens {dup} are listed twice")
    for key in ("eos", "pad"):
        if spec[key] is not None and spec[key] not in spec["special"]:
            raise ConfigError(f"{where}: tokenizer.{key}={spec[key]!r} must be one of tokenizer.special")
    for tok in spec["generation_eos"] or []:
        if tok not in spec["special"]:
            raise ConfigError(f"{where}: tokenizer.generation_eos entry {tok!r} must be one of tokenizer.special")
    return spec


def build_tokenizer(section: dict[str, Any], where: str = "model YAML"):
    """A ``transformers`` fast tokenizer for ``section`` (module docstring)."""
    # lazy: transformers is heavy, and the YAML checks above need neither package
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    spec = _spec(section, where)
    ordered = [*spec["special"], *spec["words"], *spec["chars"], spec["unk"]]
    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(ordered)}, unk_token=spec["unk"]))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one piece per character
    core.decoder = decoders.Fuse()  # characters join without separators
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec["special"]])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["words"]])
    template = CHAT_TEMPLATES.get(spec["chat_template"], spec["chat_template"])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token=spec["unk"], eos_token=spec["eos"],
                                  pad_token=spec["pad"])
    tok.chat_template = template
    return tok


class TinyTokenizer:
    """The tokenizer of one ``tokenizer:`` section, checked against the model's ``vocab_size``."""

    def __init__(self, section: dict[str, Any], hf_fields: dict[str, Any], where: str = "model YAML") -> None:
        self.spec = _spec(section, where)
        self.tok = build_tokenizer(section, where)
        vocab = int(hf_fields.get("vocab_size", 0))
        if len(self.tok) > vocab:
            raise ConfigError(f"{where}: the tokenizer has {len(self.tok)} tokens but vocab_size is {vocab}; "
                              f"raise vocab_size to at least {len(self.tok)}")

    def config_ids(self) -> dict[str, int | None]:
        """``eos/pad/bos_token_id`` for config.json (no BOS: like Qwen3, prompts start with the template)."""
        return {"eos_token_id": self.tok.eos_token_id, "pad_token_id": self.tok.pad_token_id, "bos_token_id": None}

    def save(self, out_dir: str | Path) -> None:
        """Tokenizer files, chat template and ``generation_config.json`` into ``out_dir``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.tok.save_pretrained(out)
        names = self.spec["generation_eos"] or [self.spec["eos"]]
        eos_ids = [self.tok.convert_tokens_to_ids(t) for t in names if t]
        gen = {"eos_token_id": eos_ids if len(eos_ids) != 1 else eos_ids[0], "pad_token_id": self.tok.pad_token_id,
               "do_sample": True}
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
