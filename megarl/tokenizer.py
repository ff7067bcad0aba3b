"""The run's tokenizer: one ``transformers.AutoTokenizer`` for data, stopping, rewards, samples and evaluation.

Engines and the trainer speak token ids only; text exists at the edges of a
run, and all of it goes through :class:`RunTokenizer`:

- **prompts**: a chat (list of ``{"role", "content"}`` messages) or a string
  is rendered with the tokenizer's chat template
  (``apply_chat_template(..., add_generation_prompt=True, **chat_template_kwargs)``)
  and encoded without adding special tokens again (the template already
  holds them); a string without a template is encoded as is.
- **stopping**: :attr:`stop_token_ids` = the tokenizer's EOS, every id in
  ``eos_token_id`` of the checkpoint's ``generation_config.json`` (Qwen3
  lists two) and ``rollout.stop_token_ids``. Engines keep the stop token as
  the last response token, and it is trained on.
- **rewards and samples**: responses are decoded with special tokens
  skipped; prompts are decoded as the model saw them.
- **outputs**: :meth:`save` puts the tokenizer files, the chat template and
  ``generation_config.json`` next to saved weights, so ``final/`` loads with
  ``AutoTokenizer`` and serves with ``vllm serve`` as is.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from megarl.errors import ConfigError, InputError

#: files that make a directory loadable by AutoTokenizer (any one of them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def read_generation_eos(checkpoint: str | Path) -> list[int]:
    """``eos_token_id`` of ``generation_config.json`` in ``checkpoint`` as a list (empty when absent)."""
    path = Path(checkpoint) / "generation_config.json"
    if not path.is_file():
        return []
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except json.JSONDecodeError as e:
        raise InputError(f"{path} is not valid JSON: {e}") from None
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]


class RunTokenizer:
    """The HF tokenizer of a run plus the stop ids and chat-template settings around it."""

    def __init__(self, hf_tokenizer: Any, *, source: str, stop_token_ids: list[int],
                 chat_template: str = "auto", chat_template_kwargs: dict[str, Any] | None = None,
                 generation_config: Path | None = None, model_max_len: int = 1 << 20) -> None:
        self.hf = hf_tokenizer
        self.source = source
        self.stop_token_ids = sorted(set(stop_token_ids))
        if chat_template not in ("auto", "true", "false", True, False):
            raise ConfigError(f"data.apply_chat_template={chat_template!r}; choose auto, true or false")
        has_template = bool(getattr(hf_tokenizer, "chat_template", None))
        mode = str(chat_template).lower()
        if mode == "true" and not has_template:
            raise ConfigError(f"data.apply_chat_template=true but the tokenizer in {source} has no chat template; "
                              f"set data.apply_chat_template=false or use a tokenizer with one")
        self.use_template = has_template if mode == "auto" else mode == "true"
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.generation_config = generation_config
        #: the model's context length (max_position_embeddings): no sequence may be longer
        self.model_max_len = model_max_len

    @classmethod
    def load(cls, model_cfg: Any, rollout_cfg: Any, data_cfg: Any, vocab_size: int | None = None) -> "RunTokenizer":
        """From ``model.tokenizer`` (or ``model.checkpoint``), with stop ids and template settings of the config."""
        source = model_cfg.tokenizer or model_cfg.checkpoint
        path = Path(source)
        if path.is_dir() and not any((path / f).is_file() for f in TOKENIZER_FILES):
            raise ConfigError(f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {path}: copy the tokenizer of "
                              f"the model there, or set model.tokenizer to a directory that has them")
        from transformers import AutoTokenizer  # lazy: heavy; the checks above fail fast without it

        try:
            hf = AutoTokenizer.from_pretrained(str(source))
        except Exception as e:  # a missing hub name, a broken file: fatal before the run
            raise ConfigError(f"cannot load the tokenizer from {source} (model.tokenizer / model.checkpoint): "
                              f"{type(e).__name__}: {e}") from None
        ckpt = Path(model_cfg.checkpoint)
        gen_eos = read_generation_eos(ckpt) or (read_generation_eos(path) if path.is_dir() else [])
        stop = list(gen_eos) + list(rollout_cfg.stop_token_ids)
        if hf.eos_token_id is not None:
            stop.append(int(hf.eos_token_id))
        if not stop:
            raise ConfigError(f"no stop token: the tokenizer in {source} has no eos_token, {ckpt} has no "
                              f"generation_config.json eos_token_id, and rollout.stop_token_ids is empty; responses "
                              f"would always run to rollout.max_new_tokens. Set rollout.stop_token_ids")
        if vocab_size is not None:
            bad = [t for t in stop if not 0 <= t < vocab_size]
            if bad:
                raise ConfigError(f"stop token ids {bad} are outside the model's vocabulary [0, {vocab_size}) "
                                  f"(rollout.stop_token_ids / generation_config.json)")
            if len(hf) > vocab_size:
                raise ConfigError(f"the tokenizer in {source} has {len(hf)} tokens, more than the model's "
                                  f"vocab_size {vocab_size}: tokenizer and checkpoint do not belong together")
        gen_path = next((p / "generation_config.json" for p in (ckpt, path)
                         if (p / "generation_config.json").is_file()), None)
        config = ckpt / "config.json"
        max_len = int(json.loads(config.read_text()).get("max_position_embeddings", 1 << 20)) if config.is_file() \
            else 1 << 20
        return cls(hf, source=str(source), stop_token_ids=stop, chat_template=data_cfg.apply_chat_template,
                   chat_template_kwargs=data_cfg.chat_template_kwargs, generation_config=gen_path,
                   model_max_len=max_len)

    def __len__(self) -> int:
        return len(self.hf)

    # -- prompts ---------------------------------------------------------------------------
    def render(self, prompt: str | list[dict[str, Any]], where: str = "prompt") -> str:
        """The text the model sees for ``prompt`` (a string or a list of chat messages)."""
        if isinstance(prompt, str) and not self.use_template:
            return prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not self.use_template:
            raise InputError(f"{where}: the prompt is a list of chat messages but no chat template is applied "
                             f"(data.apply_chat_template=false, or the tokenizer has none)")
        check_messages(messages, where)
        try:
            return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                               **self.chat_template_kwargs)
        except Exception as e:  # a template error names a missing field or kwarg
            raise InputError(f"{where}: the chat template failed: {type(e).__name__}: {e}") from None

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """A whole conversation (an agent's turn), tools included, with the generation prompt."""
        if not self.use_template:
            raise InputError("an agent conversation needs a chat template (data.apply_chat_template is false or "
                             f"the tokenizer in {self.source} has none)")
        check_messages(messages, "agent conversation")
        return self.hf.apply_chat_template(object_arguments(messages), tools=tools or None, tokenize=False,
                                           add_generation_prompt=True, **self.chat_template_kwargs)

    def supports_tools(self) -> bool:
        """Whether the chat template shows tools to the model (a probe tool's name appears in the rendering)."""
        probe = {"type": "function", "function": {"name": "megarl_probe_tool", "description": "probe",
                                                  "parameters": {"type": "object", "properties": {}}}}
        try:
            text = self.render_chat([{"role": "user", "content": "hi"}], tools=[probe])
        except Exception:  # a template that fails on tools does not support them
            return False
        return "megarl_probe_tool" in text

    def encode_rendered(self, texts: list[str]) -> list[list[int]]:
        """Token ids of rendered prompts (no special tokens added when a template rendered them)."""
        if not texts:
            return []
        return [list(ids) for ids in self.hf(texts, add_special_tokens=not self.use_template)["input_ids"]]

    def encode_after(self, context_ids: list[int], text: str, new_text: str) -> list[int]:
        """Ids of ``new_text`` as it tokenizes after ``context_ids``, the ids of ``text[:-len(new_text)]``.

        Tokenized on its own, a text can come out differently than after what precedes it (SentencePiece-style
        tokenizers put a word-start marker at the start of a text). So: the ids ``text`` tokenizes to after
        ``context_ids``, when it tokenizes to ``context_ids`` first (the usual case); else (the model's own
        tokens are not how its text tokenizes) ``new_text`` after the text of the context's last token.
        """
        whole = self.hf.encode(text, add_special_tokens=False)
        if whole[:len(context_ids)] == context_ids:
            return whole[len(context_ids):]
        anchor = self.hf.decode(context_ids[-1:], skip_special_tokens=False)
        anchor_ids = self.hf.encode(anchor, add_special_tokens=False)
        ids = self.hf.encode(anchor + new_text, add_special_tokens=False)
        if anchor_ids and ids[:len(anchor_ids)] == anchor_ids:
            return ids[len(anchor_ids):]
        return self.hf.encode(new_text, add_special_tokens=False)  # the anchor merged into new_text's tokens

    # -- decoding --------------------------------------------------------------------------
    def decode_response(self, ids: list[int]) -> str:
        """What a reward reads: the response with special tokens (EOS, template markers) skipped."""
        return self.hf.decode(ids, skip_special_tokens=True)

    def decode_prompt(self, ids: list[int]) -> str:
        """The prompt as the model saw it, template markers included."""
        return self.hf.decode(ids, skip_special_tokens=False)

    # -- outputs ---------------------------------------------------------------------------
    def save(self, out_dir: str | Path) -> None:
        """Tokenizer files, chat template and ``generation_config.json`` into ``out_dir`` (an HF model directory)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.hf.save_pretrained(str(out))
        if self.generation_config is not None:
            shutil.copyfile(self.generation_config, out / "generation_config.json")
        else:
            gen = {"eos_token_id": self.stop_token_ids if len(self.stop_token_ids) > 1 else self.stop_token_ids[0]}
            (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def object_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each tool call's ``arguments`` as an object, not OpenAI's JSON string.

    Chat templates (Qwen2.5's, Llama 3.1's and 4's) write ``arguments | tojson``: a JSON string would render
    double-encoded (``"{\\"a\\": 1}"``), the past would no longer read as the model wrote it, and every agent
    turn after a tool call would start a new trajectory. Arguments that are not a JSON object (a malformed
    call's raw text) stay as they are. The caller's messages are not changed.
    """
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls:
            m = {**m, "tool_calls": [_object_call(c) for c in calls]}
        out.append(m)
    return out


def _object_call(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    holder, key = (fn, "function") if isinstance(fn, dict) else (call, None)
    args = holder.get("arguments") if isinstance(holder, dict) else None
    if not isinstance(args, str):
        return call
    try:
        parsed = json.loads(args)
    except json.JSONDecodeError:
        return call
    if not isinstance(parsed, dict):
        return call
    holder = {**holder, "arguments": parsed}
    return {**call, key: holder} if key else holder


def check_messages(messages: Any, where: str) -> None:
    """A chat is a non-empty list of ``{"role": str, "content": str}``; name the first bad message."""
    if not isinstance(messages, list) or not messages:
        raise InputError(f"{where}: a chat prompt must be a non-empty list of {{'role', 'content'}} messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise InputError(f"{where}: message {i} must be an object with 'role' and 'content', got {m!r:.120}")
