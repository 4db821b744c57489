"""ImageReward on transformers' BLIP modules computes what the released model computes, from its checkpoint layout.

The ``image-reward`` package is not a dependency: ``Reference`` re-implements its scoring path in plain torch with the
parameter names of ``ImageReward.pt`` (BLIP's timm-style ViT with eps 1e-6, BLIP's BERT with cross-attention in
every layer, the ``[CLS]`` state through the MLP, then ``(r - mean) / std``). A random-init instance's state dict is
saved as the released file is (a bare state dict, plus unused BLIP keys) and scored through ``build_scorer``. The two
paths run different kernels (fused vs separate attention), so scores agree within fp32 rounding (atol 1e-4 on values
of magnitude ~1-10 after the division by std), not bitwise.
"""

import io
import math

import numpy as np

import pytest
import torch
from torch import nn
from tests.unit.reward.reward_images import flat_png, noise_png

from unirl_core.errors import ConfigError
from unirl_core.reward import ScoreItem, build_scorer
from unirl_core.reward.scorers.clip import AestheticHead
from unirl_core.reward.scorers.image_reward import CLIP_MEAN, CLIP_STD, MEAN, STD

torch.set_num_threads(1)
VW, VH, VL, PATCH, IMAGE = 32, 2, 2, 8, 32  # vision width, heads, layers
TW, TH, TL, POS = 24, 2, 2, 40  # text width, heads, layers, positions


def _ln(n, eps):
    ln = nn.LayerNorm(n, eps=eps)
    nn.init.normal_(ln.weight, 1.0, 0.1)
    nn.init.normal_(ln.bias, 0.0, 0.1)
    return ln


class ViTBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = _ln(VW, 1e-6), _ln(VW, 1e-6)
        self.attn = nn.Module()
        self.attn.qkv, self.attn.proj = nn.Linear(VW, 3 * VW), nn.Linear(VW, VW)
        self.mlp = nn.Module()
        self.mlp.fc1, self.mlp.fc2 = nn.Linear(VW, 4 * VW), nn.Linear(4 * VW, VW)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.attn.qkv(self.norm1(x)).reshape(b, n, 3, VH, VW // VH).permute(2, 0, 3, 1, 4)
        a = ((q @ k.transpose(-2, -1)) * (VW // VH) ** -0.5).softmax(-1)
        x = x + self.attn.proj((a @ v).transpose(1, 2).reshape(b, n, VW))
        return x + self.mlp.fc2(nn.functional.gelu(self.mlp.fc1(self.norm2(x))))


class ViT(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, VW, PATCH, PATCH)
        self.cls_token = nn.Parameter(0.1 * torch.randn(1, 1, VW))
        self.pos_embed = nn.Parameter(0.1 * torch.randn(1, (IMAGE // PATCH) ** 2 + 1, VW))
        self.blocks = nn.ModuleList([ViTBlock() for _ in range(VL)])
        self.norm = _ln(VW, 1e-6)

    def forward(self, px):
        x = self.patch_embed.proj(px).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)


class BertAttention(nn.Module):
    def __init__(self, kv_dim):
        super().__init__()
        self.self = nn.Module()
        self.self.query, self.self.key, self.self.value = nn.Linear(TW, TW), nn.Linear(kv_dim, TW), nn.Linear(kv_dim, TW)
        self.output = nn.Module()
        self.output.dense, self.output.LayerNorm = nn.Linear(TW, TW), _ln(TW, 1e-12)

    def forward(self, x, ctx, bias):
        def heads(t):
            return t.reshape(t.shape[0], t.shape[1], TH, TW // TH).transpose(1, 2)
        q, k, v = heads(self.self.query(x)), heads(self.self.key(ctx)), heads(self.self.value(ctx))
        a = ((q @ k.transpose(-2, -1)) / math.sqrt(TW // TH) + bias).softmax(-1)
        y = (a @ v).transpose(1, 2).reshape(x.shape)
        return self.output.LayerNorm(self.output.dense(y) + x)


class BertLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention, self.crossattention = BertAttention(TW), BertAttention(VW)
        self.intermediate = nn.Module()
        self.intermediate.dense = nn.Linear(TW, 4 * TW)
        self.output = nn.Module()
        self.output.dense, self.output.LayerNorm = nn.Linear(4 * TW, TW), _ln(TW, 1e-12)

    def forward(self, x, image, bias):
        x = self.attention(x, x, bias)
        x = self.crossattention(x, image, 0.0)
        return self.output.LayerNorm(self.output.dense(nn.functional.gelu(self.intermediate.dense(x))) + x)


class Bert(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.embeddings = nn.Module()
        self.embeddings.word_embeddings = nn.Embedding(vocab, TW)
        self.embeddings.position_embeddings = nn.Embedding(POS, TW)
        self.embeddings.LayerNorm = _ln(TW, 1e-12)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList([BertLayer() for _ in range(TL)])

    def forward(self, ids, mask, image):
        e = self.embeddings
        x = e.LayerNorm(e.word_embeddings(ids) + e.position_embeddings(torch.arange(ids.shape[1])))
        bias = (1.0 - mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        for layer in self.encoder.layer:
            x = layer(x, image, bias)
        return x


class Reference(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.blip = nn.Module()
        self.blip.visual_encoder, self.blip.text_encoder = ViT(), Bert(vocab)
        self.blip.itm_head = nn.Linear(TW, 2)  # one of the BLIP keys the released file has and scoring ignores
        self.mlp = AestheticHead(in_dim=TW)

    def score(self, px, ids, mask):
        text = self.blip.text_encoder(ids, mask, self.blip.visual_encoder(px))
        return ((self.mlp(text[:, 0]) - MEAN) / STD)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from transformers import BertTokenizer

    path = tmp_path_factory.mktemp("bert_tok")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz", "##s", "a", "the"]
    (path / "vocab.txt").write_text("\n".join(dict.fromkeys(words)) + "\n")
    BertTokenizer(str(path / "vocab.txt")).save_pretrained(str(path))
    return str(path)


def _preprocess(items):
    """The package's transform: bicubic short side to IMAGE, center crop, to [0, 1], CLIP normalisation."""
    from PIL import Image

    out = []
    for it in items:
        im = Image.open(io.BytesIO(it.media)).convert("RGB")
        w, h = im.size
        s = IMAGE / min(w, h)
        im = im.resize((round(w * s), round(h * s)), Image.BICUBIC)
        left, top = (im.size[0] - IMAGE) // 2, (im.size[1] - IMAGE) // 2
        im = im.crop((left, top, left + IMAGE, top + IMAGE))
        t = torch.from_numpy(np.asarray(im, dtype=np.float32)).permute(2, 0, 1) / 255
        out.append((t - torch.tensor(CLIP_MEAN)[:, None, None]) / torch.tensor(CLIP_STD)[:, None, None])
    return torch.stack(out)


def test_image_reward_scores_the_released_layout_as_the_package_does(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    ref = Reference(vocab=len(tok) + 2).eval()  # + [DEC], [ENC], as BLIP's tokenizer adds them
    path = tmp_path / "ImageReward.pt"
    torch.save(ref.state_dict(), path)  # the released file is a bare state dict
    items = [ScoreItem(prompt="a flat square", media=flat_png()), ScoreItem(prompt="the static", media=noise_png(1))]
    got = build_scorer("image_reward", model=str(path), tokenizer=tokenizer_dir, vision_heads=VH, text_heads=TH)(items)
    t = tok([it.prompt for it in items], padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    with torch.no_grad():
        want = ref.score(_preprocess(items), t["input_ids"], t["attention_mask"])
    assert got == pytest.approx(want.tolist(), abs=1e-4)
    assert abs(got[0] - got[1]) > 1e-3  # the two images score differently: the score reads the image


def test_image_reward_errors(tmp_path, tokenizer_dir):
    with pytest.raises(ConfigError, match="ImageReward checkpoint.*existing"):
        build_scorer("image_reward", model=str(tmp_path / "missing.pt"), tokenizer=tokenizer_dir)
    torch.save({"w": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(ConfigError, match="ImageReward's state dict"):
        build_scorer("image_reward", model=str(tmp_path / "other.pt"), tokenizer=tokenizer_dir)
