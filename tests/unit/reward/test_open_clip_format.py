"""HPS-v2's open_clip checkpoint format, converted to a transformers CLIPModel, computes what open_clip computes.

open_clip is not a dependency: ``OpenClipReference`` re-implements, in plain torch, the forward of open_clip's
``CLIP`` with the module and parameter names its state dict has (``ResidualAttentionBlock`` over
``nn.MultiheadAttention`` with the packed ``in_proj_weight``, ``x @ text_projection``, end-of-text by ``argmax``).
A random-init instance is saved as ``{"state_dict": ...}`` (the released HPS-v2 layout) and read back through the
converter. The two paths run different kernels (packed vs split q/k/v matmuls), so features agree within fp32
rounding (atol 1e-5 at magnitudes ~1), not bitwise.
"""

import io
from collections import OrderedDict

import pytest
import torch
from torch import nn
from unirl_core.config.rehearsal import byte_chars
from tests.unit.reward.reward_images import flat_png, noise_png

from unirl_core.errors import ConfigError
from unirl_core.reward import ScoreItem, build_scorer
from unirl_core.reward.scorers.open_clip_format import convert, main, read_checkpoint

torch.set_num_threads(1)
WIDTH, HEADS, LAYERS, PATCH, IMAGE, CONTEXT, EMBED = 32, 2, 2, 8, 32, 32, 16


class Block(nn.Module):
    """open_clip's ``ResidualAttentionBlock`` (sequence-first layout)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads)
        self.mlp = nn.Sequential(OrderedDict(c_fc=nn.Linear(width, 4 * width), gelu=nn.GELU(),
                                             c_proj=nn.Linear(4 * width, width)))

    def forward(self, x, mask=None):
        y = self.ln_1(x)
        x = x + self.attn(y, y, y, need_weights=False, attn_mask=mask)[0]
        return x + self.mlp(self.ln_2(x))


class Tower(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.resblocks = nn.ModuleList([Block(width, HEADS) for _ in range(LAYERS)])

    def forward(self, x, mask=None):
        for b in self.resblocks:
            x = b(x, mask)
        return x


class Visual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        grid = IMAGE // PATCH
        self.conv1 = nn.Conv2d(3, WIDTH, PATCH, PATCH, bias=False)
        self.class_embedding = nn.Parameter(0.1 * torch.randn(WIDTH))
        self.positional_embedding = nn.Parameter(0.1 * torch.randn(grid * grid + 1, WIDTH))
        self.ln_pre, self.ln_post = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.transformer = Tower(WIDTH)
        self.proj = nn.Parameter(0.1 * torch.randn(WIDTH, EMBED))

    def forward(self, px):
        x = self.conv1(px).flatten(2).permute(0, 2, 1)  # [B, grid^2, W]
        x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1) + self.positional_embedding
        x = self.transformer(self.ln_pre(x).permute(1, 0, 2)).permute(1, 0, 2)
        return self.ln_post(x[:, 0]) @ self.proj


class OpenClipReference(nn.Module):
    """open_clip's ``CLIP`` (text tower inline, vision tower under ``visual``)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, WIDTH)
        self.positional_embedding = nn.Parameter(0.1 * torch.randn(CONTEXT, WIDTH))
        self.transformer = Tower(WIDTH)
        self.ln_final = nn.LayerNorm(WIDTH)
        self.text_projection = nn.Parameter(0.1 * torch.randn(WIDTH, EMBED))
        self.logit_scale = nn.Parameter(torch.tensor(2.0))
        self.visual = Visual()
        for m in self.modules():  # non-trivial norms, so a swapped weight / bias would show
            if isinstance(m, nn.LayerNorm):
                nn.init.normal_(m.weight, 1.0, 0.1)
                nn.init.normal_(m.bias, 0.0, 0.1)

    def encode_text(self, ids):
        n = ids.shape[1]
        mask = torch.full((n, n), float("-inf")).triu(1)
        x = (self.token_embedding(ids) + self.positional_embedding[:n]).permute(1, 0, 2)
        x = self.ln_final(self.transformer(x, mask).permute(1, 0, 2))
        return x[torch.arange(x.shape[0]), ids.argmax(dim=-1)] @ self.text_projection

    def encode_image(self, px):
        return self.visual(px)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A CLIP processor whose start/end-of-text tokens are the two last ids, as in open_clip's tokenizer."""
    from transformers import CLIPImageProcessorPil, CLIPProcessor, CLIPTokenizer

    vocab = {}
    for suffix in ("", "</w>"):
        for c in byte_chars():
            vocab[c + suffix] = len(vocab)
    vocab["<|startoftext|>"], vocab["<|endoftext|>"] = len(vocab), len(vocab) + 1
    tok = CLIPTokenizer(vocab=vocab, merges=[], pad_token="<|endoftext|>")
    proc = CLIPProcessor(image_processor=CLIPImageProcessorPil(size={"shortest_edge": IMAGE},
                                                               crop_size={"height": IMAGE, "width": IMAGE}),
                         tokenizer=tok)
    path = tmp_path_factory.mktemp("open_clip_tok")
    proc.save_pretrained(path)
    return str(path), len(vocab)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer_dir):
    torch.manual_seed(0)
    ref = OpenClipReference(vocab=tokenizer_dir[1]).eval()
    path = tmp_path_factory.mktemp("hps") / "HPS_tiny.pt"
    torch.save({"state_dict": ref.state_dict(), "epoch": 1}, path)  # the released files' layout
    return ref, str(path)


def test_converted_model_computes_open_clips_features(checkpoint, tokenizer_dir):
    ref, path = checkpoint
    model = convert(read_checkpoint(path), text_heads=HEADS, vision_heads=HEADS)
    torch.manual_seed(1)
    vocab = tokenizer_dir[1]
    ids = torch.randint(0, vocab - 2, (3, 12))
    ids[:, 0], ids[0, 11], ids[1, 5], ids[2, 8] = vocab - 2, vocab - 1, vocab - 1, vocab - 1
    px = torch.randn(3, 3, IMAGE, IMAGE)
    with torch.no_grad():
        got_t, want_t = model.get_text_features(input_ids=ids), ref.encode_text(ids)
        got_i, want_i = model.get_image_features(pixel_values=px), ref.encode_image(px)
    got_t = got_t if isinstance(got_t, torch.Tensor) else got_t.pooler_output
    got_i = got_i if isinstance(got_i, torch.Tensor) else got_i.pooler_output
    torch.testing.assert_close(got_t, want_t, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_i, want_i, rtol=0, atol=1e-5)
    assert float(model.logit_scale.detach()) == float(ref.logit_scale.detach())
    assert want_t.abs().max() > 0.1 and want_i.abs().max() > 0.1  # features that a wrong weight would move


def test_hpsv2_scores_an_open_clip_checkpoint_and_its_converted_folder(checkpoint, tokenizer_dir, tmp_path):
    from PIL import Image

    from transformers import CLIPProcessor

    ref, path = checkpoint
    items = [ScoreItem(prompt="a purple square", media=flat_png()),
             ScoreItem(prompt="television static", media=noise_png(1))]
    got = build_scorer("hpsv2", model=path, processor=tokenizer_dir[0], text_heads=HEADS, vision_heads=HEADS)(items)
    proc = CLIPProcessor.from_pretrained(tokenizer_dir[0])
    batch = proc(text=[it.prompt for it in items], images=[Image.open(io.BytesIO(it.media)).convert("RGB")
                                                          for it in items], return_tensors="pt", padding=True)
    with torch.no_grad():
        t = nn.functional.normalize(ref.encode_text(batch["input_ids"]), dim=-1)
        i = nn.functional.normalize(ref.encode_image(batch["pixel_values"]), dim=-1)
    assert got == pytest.approx((t * i).sum(-1).tolist(), abs=1e-5)

    main([path, str(tmp_path / "hps"), "--text-heads", str(HEADS), "--vision-heads", str(HEADS),
          "--processor", tokenizer_dir[0]])
    assert build_scorer("hpsv2", model=str(tmp_path / "hps"))(items) == pytest.approx(got, abs=1e-6)


def test_converter_errors(tmp_path, checkpoint):
    with pytest.raises(ConfigError, match="open_clip checkpoint.*existing"):
        read_checkpoint(str(tmp_path / "missing.pt"))
    torch.save({"state_dict": {"w": torch.zeros(1)}}, tmp_path / "other.pt")
    with pytest.raises(ConfigError, match="open_clip CLIP state dict"):
        read_checkpoint(str(tmp_path / "other.pt"))
    with pytest.raises(ConfigError, match="text_heads=3"):
        convert(read_checkpoint(checkpoint[1]), text_heads=3, vision_heads=HEADS)
