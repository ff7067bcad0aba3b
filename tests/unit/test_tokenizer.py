"""The run's tokenizer: loading, stop ids from generation_config.json, decoding, saving next to weights."""
import json
import shutil

import pytest
from conftest import DEMO, chat_prompt, digits, run_tokenizer

from megarl.config.schema import DataConfig, ModelConfig, RolloutConfig
from megarl.errors import ConfigError
from megarl.tokenizer import RunTokenizer


def test_stop_ids_are_eos_generation_config_and_config(demo_tokenizer_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(demo_tokenizer_dir, ckpt)
    assert run_tokenizer(ckpt).stop_token_ids == [DEMO.ENDOFTEXT, DEMO.IM_END]
    # a single eos id in generation_config.json, plus rollout.stop_token_ids
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": DEMO.ENDOFTEXT}))
    tok = RunTokenizer.load(ModelConfig(checkpoint=str(ckpt)), RolloutConfig(stop_token_ids=[DEMO.NEWLINE]),
                            DataConfig())
    assert tok.stop_token_ids == [DEMO.ENDOFTEXT, DEMO.IM_END, DEMO.NEWLINE]
    with pytest.raises(ConfigError, match=r"stop token ids \[16\] are outside the model's vocabulary \[0, 10\)"):
        RunTokenizer.load(ModelConfig(checkpoint=str(ckpt)), RolloutConfig(stop_token_ids=[16]), DataConfig(),
                          vocab_size=10)


def test_a_checkpoint_without_tokenizer_files_names_the_fix(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=rf"no tokenizer files .* in {tmp_path}: .*set model.tokenizer"):
        run_tokenizer(tmp_path)


def test_model_tokenizer_overrides_the_checkpoint(demo_tokenizer_dir, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    tok = RunTokenizer.load(ModelConfig(checkpoint=str(tmp_path), tokenizer=str(demo_tokenizer_dir)),
                            RolloutConfig(), DataConfig())
    # the generation config comes with the tokenizer when the checkpoint has none
    assert tok.stop_token_ids == [DEMO.ENDOFTEXT, DEMO.IM_END]


def test_a_tokenizer_larger_than_the_model_is_refused(demo_tokenizer_dir):
    with pytest.raises(ConfigError, match="has 18 tokens, more than the model's vocab_size 16"):
        RunTokenizer.load(ModelConfig(checkpoint=str(demo_tokenizer_dir)), RolloutConfig(), DataConfig(),
                          vocab_size=16)


def test_template_required_but_missing(tmp_path, demo_tokenizer_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(demo_tokenizer_dir))
    hf.chat_template = None
    hf.save_pretrained(str(tmp_path))
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    assert not run_tokenizer(tmp_path).use_template  # auto: no template, strings go in as they are
    with pytest.raises(ConfigError, match="has no chat template"):
        run_tokenizer(tmp_path, apply_chat_template=True)


def test_decoding_for_rewards_skips_special_tokens(demo_tokenizer):
    response = digits("321") + [DEMO.IM_END]
    assert demo_tokenizer.decode_response(response) == "321"
    assert demo_tokenizer.decode_prompt(chat_prompt("123")) == \
        "<|im_start|>user\n123<|im_end|>\n<|im_start|>assistant\n"


def test_save_makes_a_loadable_model_directory(demo_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    demo_tokenizer.save(tmp_path)
    again = AutoTokenizer.from_pretrained(str(tmp_path))
    assert again.apply_chat_template([{"role": "user", "content": "12"}], tokenize=False,
                                     add_generation_prompt=True) == demo_tokenizer.render("12")
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == [DEMO.IM_END,
                                                                                            DEMO.ENDOFTEXT]
