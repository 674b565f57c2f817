"""docs/finetuning.md's own-loop example, run as written on 4 ranks (TP 2 + SP x DP 2) in a directory holding the
tiny chat model and packed chat data its first commands make (fewer conversations): it trains, and the loss falls."""
import importlib.util
import os
import re

from harness import run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _snippet():
    text = open(os.path.join(ROOT, "docs", "finetuning.md")).read()
    block = re.search(r"## In your own DeepSpeed loop.*?```python\n(.*?)```", text, re.S).group(1)
    return block.replace("ds_configs/", os.path.join(ROOT, "ds_configs") + "/")


def _run(workdir):
    os.chdir(workdir)  # the example's runs/ paths
    losses = []
    code = _snippet().replace("    engine.step()", "    engine.step()\n    losses.append(float(loss))")
    scope = {"losses": losses}
    exec(compile(code, "docs/finetuning.md", "exec"), scope)
    scope["engine"].megatron.state.destroy()
    return losses


def test_the_own_loop_example_fine_tunes(tmp_path):
    spec = importlib.util.spec_from_file_location("maker", os.path.join(ROOT, "launch", "make_tiny_chat_model.py"))
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    runs = tmp_path / "runs"
    assert maker.main([str(runs / "hf" / "tiny-chat"), "--data", str(runs / "data" / "chat.jsonl"),
                       "--conversations", "96"]) == 0
    from ds_megatron.data.preprocess import preprocess_sft  # the config's data_path must exist
    preprocess_sft(str(runs / "data" / "chat.jsonl"), str(runs / "data" / "chat"), str(runs / "hf" / "tiny-chat"),
                   512)
    for losses in run_on_ranks(4, _run, str(tmp_path)):
        assert len(losses) == 96 // 8 // 2  # 8 chats a batch, each of the 2 data-parallel ranks its own
        assert losses[-1] < losses[0] - 0.1, losses
