"""``ds_megatron.from_pretrained``: transformers' logits (float64) at TP=1 from a Hugging Face directory and from
ours, the same logits at TP=2 (SP too) on two gloo ranks, then ``ds_megatron.initialize`` trains on it from
transformers' loss; with PP this rank's ``GPTModelChunks`` (virtual stages) holding the one-rank model's weights;
refusals in one line."""
import pytest
import torch
import torch.distributed as dist

import hf_models
from harness import run_on_ranks

import ds_megatron
from ds_megatron.config import ConfigError
from ds_megatron.convert.checkpoint import hf_to_ours
from ds_megatron.convert.model_io import model_tensors
from ds_megatron.models import GPTModel

FAMILY, LAYERS = "qwen3", 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(the transformers model, its directory, our directory at TP=2)."""
    tmp = tmp_path_factory.mktemp("pretrained")
    model = hf_models.make_model(FAMILY, num_hidden_layers=LAYERS)
    hf_dir = hf_models.save(model, str(tmp / "hf"))
    return model, hf_dir, hf_to_ours(hf_dir, str(tmp / "ours_tp2"), tp=2)


def test_tp1_gives_transformers_logits_from_both_kinds_of_directory(checkpoint, tmp_path):
    hf_model, hf_dir, _ = checkpoint
    toks = hf_models.tokens()
    ref = hf_models.reference_logits(hf_model, toks)
    ours = hf_to_ours(hf_dir, str(tmp_path / "ours_tp1"))
    for path in (hf_dir, ours):
        model = ds_megatron.from_pretrained(path, dtype=torch.float64, hidden_dropout=0.0, seq_length=hf_models.SEQ)
        assert type(model) is GPTModel and model.config.seq_length == hf_models.SEQ
        with torch.no_grad():
            got = model.eval()(toks)[..., :hf_models.VOCAB]
        assert hf_models.max_relative_error(got, ref) < 1e-10, path


def test_refusals_name_the_option(checkpoint, tmp_path):
    _, hf_dir, ours_tp2 = checkpoint
    for options, match in ((dict(num_layers=3), r"model.num_layers=3 would change the architecture .* \(4\)"),
                           (dict(flash=True), "unknown option 'flash'"),
                           (dict(layernorm_epsilon=1e-3), "model.layernorm_epsilon=0.001 would change"),
                           (dict(virtual_pipeline_model_parallel_size=2), "pipeline_model_parallel_size 1"),
                           (dict(seq_length=65), "seq_length=65 exceeds the 64 positions")):
        with pytest.raises(ConfigError, match=match) as e:
            ds_megatron.from_pretrained(hf_dir, **options)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="neither a Hugging Face checkpoint"):
        ds_megatron.from_pretrained(str(tmp_path))
    with pytest.raises(ConfigError, match="layout .* differs"):  # ours at TP=2, this job at TP=1
        ds_megatron.from_pretrained(ours_tp2)
    # the checkpoint's own value of an architecture field is no change
    assert ds_megatron.from_pretrained(hf_dir, num_layers=LAYERS).config.num_layers == LAYERS


def _gather_vocab(logits, state):
    parts = [torch.empty_like(logits) for _ in range(state.tp.size)]
    dist.all_gather(parts, logits.contiguous(), group=state.tp.group)
    return torch.cat(parts, dim=-1)[..., :hf_models.VOCAB]


def _tp2_logits_and_training(hf_dir, ours_tp2, toks, labels):
    cfg = {"train_micro_batch_size_per_gpu": toks.size(0), "steps_per_print": 10 ** 6, "gradient_clipping": 0.0,
           "megatron": {"tensor_model_parallel_size": 2}}
    state = ds_megatron.initialize_model_parallel(cfg)
    logits = {}
    for name, path, sp in (("ours", ours_tp2, False), ("hf", hf_dir, True)):
        model = ds_megatron.from_pretrained(path, state, dtype=torch.float64, sequence_parallel=sp)
        with torch.no_grad():
            logits[name] = _gather_vocab(model.eval()(toks), state)
    model = ds_megatron.from_pretrained(ours_tp2, state)  # float32, for the engine
    engine, _, _, _ = ds_megatron.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                             config=cfg, parallel_state=state)
    losses = []
    for _ in range(2):
        loss = engine(toks, labels)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    engine.megatron.destroy()
    return logits, losses


def test_tp2_gives_the_same_logits_and_trains(checkpoint):
    hf_model, hf_dir, ours_tp2 = checkpoint
    toks = hf_models.tokens()
    labels = torch.roll(toks, -1, dims=1)
    ref = hf_models.reference_logits(hf_model, toks)
    ref_loss = float(torch.nn.functional.cross_entropy(ref.reshape(-1, hf_models.VOCAB), labels.reshape(-1)))
    for logits, losses in run_on_ranks(2, _tp2_logits_and_training, hf_dir, ours_tp2, toks, labels):
        assert all(hf_models.max_relative_error(got, ref) < 1e-10 for got in logits.values())
        assert losses[0] == pytest.approx(ref_loss, rel=1e-5) and losses[1] < losses[0], (losses, ref_loss)


def _pp2_chunks(hf_dir):
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
           "megatron": {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}}
    state = ds_megatron.initialize_model_parallel(cfg)
    model = ds_megatron.from_pretrained(hf_dir, state, virtual_pipeline_model_parallel_size=2)
    assert type(model) is ds_megatron.GPTModelChunks and model.num_model_chunks == 2
    whole = model_tensors(ds_megatron.from_pretrained(hf_dir))
    mine = model_tensors(model)
    same = all(torch.equal(t, whole[name]) for name, t in mine.items())
    layers = sorted({int(n.split(".")[1]) for n in mine if n.startswith("layers.")})
    state.destroy()
    return same, layers


def test_pipeline_gives_this_ranks_chunks_with_the_checkpoints_weights(checkpoint):
    _, hf_dir, _ = checkpoint
    # virtual stages 0 | 1 | 2 | 3 (a layer each): rank 0 holds chunks 0 and 2, rank 1 chunks 1 and 3
    assert run_on_ranks(2, _pp2_chunks, hf_dir) == [(True, [0, 2]), (True, [1, 3])]
