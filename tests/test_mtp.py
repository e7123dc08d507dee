"""The multi-token-prediction head (`mtp.*`): loaded and checked like every weight, optional.

Facts (vLLM's qwen3_next_mtp.py / qwen3_5_mtp.py; no transformers model reads mtp.*): keys
without the `model.` prefix: mtp.pre_fc_norm_embedding.weight [H], mtp.pre_fc_norm_hidden.weight
[H], mtp.fc.weight [H, 2H] (no bias), mtp.layers.{i}.* (a full-attention decoder layer of the
model's own kind), mtp.norm.weight [H]; norms zero-centred (x_hat * (1 + w)) as the model's;
embedding and head shared with the model. Config field: mtp_num_hidden_layers.
"""

import json

import pytest
import torch
from helpers import write_checkpoint
from safetensors.torch import load_file, save_file

from qwen_mini import CheckpointError
from qwen_mini.checkpoint import load_checkpoint


def mtp_tensors(stored: dict, H: int, full_layer: int = 3, seed: int = 0) -> dict:
    """An MTP head's tensors as the facts above lay it out: its layer a copy of the checkpoint's
    full-attention layer `full_layer` under mtp.layers.0."""
    g = torch.Generator().manual_seed(seed)
    prefix = f"model.layers.{full_layer}."
    out = {
        "mtp." + "layers.0." + k[len(prefix) :]: v.clone()
        for k, v in stored.items()
        if k.startswith(prefix)
    }
    out["mtp.pre_fc_norm_embedding.weight"] = 0.1 * torch.randn(H, generator=g)
    out["mtp.pre_fc_norm_hidden.weight"] = 0.1 * torch.randn(H, generator=g)
    out["mtp.fc.weight"] = 0.2 * torch.randn(H, 2 * H, generator=g)
    out["mtp.norm.weight"] = 0.1 * torch.randn(H, generator=g)
    return out


@pytest.fixture
def folder(tmp_path):
    write_checkpoint(tmp_path, "qwen3_5_text", tied=False, mtp_num_hidden_layers=1)
    config = json.loads((tmp_path / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1  # as the released config.json says
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def rms(x, w, eps=1e-6):  # zero-centred RMSNorm, written out
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def test_a_checkpoint_without_mtp_weights_still_loads(folder):
    model = load_checkpoint(folder)
    assert getattr(model, "mtp", None) is None


def test_mtp_weights_load_and_drive_one_step(folder):
    stored = load_file(str(folder / "model.safetensors"))
    H = stored["model.embed_tokens.weight"].shape[1]
    head = mtp_tensors(stored, H)
    save_file({**stored, **head}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model = load_checkpoint(folder)
    for key, value in head.items():
        assert torch.equal(model.state_dict()[key], value), key
    # the head shares the model's embedding and lm_head (no copies of its own)
    assert not any(k.startswith(("mtp.embed_tokens", "mtp.lm_head")) for k in model.state_dict())
    # one step by hand: e, h normed, fc(cat[e, h]), the layer (checked against the model's own
    # layer 3, the same weights, at position 1), mtp.norm
    ids = torch.tensor([[3, 17, 5]])
    with torch.no_grad():
        hidden = {}
        hook = model.model.norm.register_forward_hook(lambda m, a, out: hidden.update(h=out))
        model(ids)
        hook.remove()
        h0 = hidden["h"][:, :1]  # the model's normed hidden state at position 0
        e1 = model.model.embed_tokens(ids[:, 1:2])  # the next token's embedding
        x = torch.cat(
            [rms(e1, head["mtp.pre_fc_norm_embedding.weight"]),
             rms(h0, head["mtp.pre_fc_norm_hidden.weight"])], -1
        ) @ head["mtp.fc.weight"].T  # fmt: skip
        from qwen_mini.rope_scaling import rotary_cos_sin

        cos, sin = rotary_cos_sin(model.config, torch.tensor([1]), x.dtype)
        x = model.model.layers[3](x, cos, sin)
        want = rms(x, head["mtp.norm.weight"])
        got = model.mtp(e1, h0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_wrong_or_missing_mtp_tensor_is_named(folder):
    stored = load_file(str(folder / "model.safetensors"))
    H = stored["model.embed_tokens.weight"].shape[1]
    head = mtp_tensors(stored, H)
    wrong = {**head, "mtp.fc.weight": torch.zeros(H, H)}
    save_file({**stored, **wrong}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"mtp\.fc\.weight.*shape"):
        load_checkpoint(folder)
    missing = {k: v for k, v in head.items() if k != "mtp.norm.weight"}
    save_file({**stored, **missing}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"mtp\.norm\.weight.*missing.*mtp_num_hidden_layers"):
        load_checkpoint(folder)


def test_qwen3_next_names_the_count_num_nextn_predict_layers():
    from helpers import tiny_config

    from qwen_mini.architectures import config_from_dict

    cfg = config_from_dict(tiny_config("qwen3_next", num_nextn_predict_layers=1))
    assert cfg.mtp_num_hidden_layers == 1


def test_the_qwen3_5_standin_carries_an_mtp_head():
    from qwen_mini.standin import load_standin

    model = load_standin("Qwen/Qwen3.5-0.8B")
    H = model.config.hidden_size
    assert model.mtp.fc.weight.shape == (H, 2 * H)
    assert len(model.mtp.layers) == 1


def _with_head(folder, config_edit) -> dict:
    """The tiny checkpoint in `folder` with an MTP head added to its weights and its config.json
    changed by `config_edit`; the head's tensors."""
    stored = load_file(str(folder / "model.safetensors"))
    head = mtp_tensors(stored, stored["model.embed_tokens.weight"].shape[1])
    save_file({**stored, **head}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config_edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    return head


def test_a_head_the_config_does_not_count_is_counted_from_the_weights(tmp_path):
    # Qwen3-Next's released config.json names neither mtp_num_hidden_layers nor
    # num_nextn_predict_layers, and its weights carry mtp.layers.0 (vLLM reads 1 by default)
    write_checkpoint(tmp_path, "qwen3_next", tied=False)

    def silent(config):
        for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
            config.pop(key, None)

    head = _with_head(tmp_path, silent)
    model = load_checkpoint(tmp_path)
    assert model.config.mtp_num_hidden_layers == 1
    state = model.state_dict()
    for key, value in head.items():
        if not key.startswith("mtp.layers."):
            assert torch.equal(state[key], value), key
    # its layer is the copy of layer 3 the head was made of (experts in the model's layout)
    layer = {k for k in state if k.startswith("mtp.layers.0.")}
    assert len(layer) > 10
    for key in layer:
        assert torch.equal(state[key], state[key.replace("mtp.layers.0.", "model.layers.3.")])
    # where config.json says 0, the weights' head is left out, as it says
    _with_head(tmp_path, lambda config: config.update(num_nextn_predict_layers=0))
    assert getattr(load_checkpoint(tmp_path), "mtp", None) is None
    # a head whose layers have a gap is refused, naming the missing layer (a huge index costs
    # nothing first: the count is how many layers the weights hold, here 2)
    stored = load_file(str(tmp_path / "model.safetensors"))
    moved = {k.replace("mtp.layers.0.", "mtp.layers.999999.", 1): v for k, v in stored.items()}
    save_file(moved, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    _with_head(tmp_path, silent)  # mtp.layers.0 again, beside mtp.layers.999999
    with pytest.raises(CheckpointError, match=r"mtp\.layers\.1\..* missing.*the weights carry"):
        load_checkpoint(tmp_path)
