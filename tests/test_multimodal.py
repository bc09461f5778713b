"""Image input, LLaVA, Qwen2-VL and Qwen2.5-VL: preprocessing, logits and greedy tokens against
transformers (its own processor and model), M-RoPE positions, the prefix cache keyed by image
content, and per-item failures."""
import base64
import io

import pytest
import torch
import torch.nn.functional as F
from PIL import Image as PILImage

from worker.engine import Engine, SamplingParams
from worker.engine.image_urls import ImageSources
from worker.engine.images import decode_image, image_processor, open_image
from worker.engine.models.qwen2_vl import repeat_frames
from worker.engine.models.config import ModelConfig
from worker.engine.models.tiny import build_tiny_llava, build_tiny_qwen2_5_vl, build_tiny_qwen2_vl
from worker.engine.req import Req

LOGIT_TOL = 5e-4  # fp32, max abs difference, as tests/test_engine.py
SIZES = [(40, 28), (28, 61), (100, 75)]  # (width, height): resized and cropped differently
# Per model: the prefill chunk, small enough that chunks split images (LLaVA's are 4 tokens,
# Qwen2-VL's and Qwen2.5-VL's 4 to 48).
CHUNK = {"LlavaForConditionalGeneration": 24, "Qwen2VLForConditionalGeneration": 16,
         "Qwen2_5_VLForConditionalGeneration": 16}


@pytest.fixture(scope="module", params=["llava", "qwen2_vl", "qwen2_5_vl"])
def vlm(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param) / "m")
    if request.param == "llava":
        # Shortest edge 32, crop 28: resizing and cropping both do something.
        return build_tiny_llava(path, shortest_edge=32, max_context=256)
    if request.param == "qwen2_5_vl":
        # Windows of 2 x 2 tokens: SIZES[2]'s 3 x 4 tokens span four, two cut short.
        return build_tiny_qwen2_5_vl(path, max_context=256)
    return build_tiny_qwen2_vl(path, max_context=256)


def picture(w, h, seed):
    g = torch.Generator().manual_seed(seed)
    return PILImage.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())


def data_url(img, fmt="PNG"):
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"


def chat(text, images, image_first=True):
    """One user message: the images and the text, in either order (OpenAI parts)."""
    parts = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
    t = {"type": "text", "text": text}
    return [{"role": "user", "content": parts + [t] if image_first else [t] + parts}]


def hf_inputs(processor, messages, images):
    """transformers' own processor on the same chat ({"type": "image"} parts)."""
    hf_chat = [m if isinstance(m["content"], str) else
               {**m, "content": [{"type": "image"} if p["type"] == "image_url" else p
                                 for p in m["content"]]} for m in messages]
    text = processor.apply_chat_template(hf_chat, add_generation_prompt=True)
    return processor(images=images or None, text=text, add_special_tokens=False,
                     return_tensors="pt")


@pytest.fixture(scope="module")
def hf(vlm):
    from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32).eval()
    if model.config.model_type == "llava":
        return AutoProcessor.from_pretrained(vlm), model
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil, Qwen2VLProcessor

    own = Qwen2_5_VLProcessor if model.config.model_type == "qwen2_5_vl" else Qwen2VLProcessor

    class ImageOnly(own):
        """Without the video processor, which needs torchvision."""

        def check_argument_for_proper_class(self, name, arg):
            return None if arg is None else super().check_argument_for_proper_class(name, arg)

    tokenizer = AutoTokenizer.from_pretrained(vlm)
    return ImageOnly(Qwen2VLImageProcessorPil.from_pretrained(vlm), tokenizer, None,
                     chat_template=tokenizer.chat_template), model


@pytest.fixture(scope="module")
def engine(vlm):
    chunk = CHUNK[ModelConfig.from_dir(vlm).architecture]
    return Engine(vlm, page_size=4, max_prefill_tokens=chunk)


def test_preprocessing_matches_transformers(vlm, hf):
    processor, _ = hf
    ours = image_processor(vlm, ModelConfig.from_dir(vlm).vision)
    # The last two: Qwen2-VL scales them up to min_pixels and down to max_pixels.
    for k, (w, h) in enumerate(SIZES + [(28, 28), (300, 41), (3, 2), (600, 400)]):
        img = decode_image(open_image(ImageSources().read(data_url(picture(w, h, k), "WEBP" if k % 2 else "PNG"))))
        ref = processor.image_processor(img, return_tensors="pt")
        got, tokens, grid = ours(img)
        want = ref["pixel_values"]
        if "image_grid_thw" in ref:  # transformers repeats the picture over its frames; ours once
            frames = want.view(want.shape[0], 3, -1, got.shape[1] // 3)  # [patches, 3, frames, p*p]
            assert frames.shape[2] == 2 and (frames == frames[:, :, :1]).all()
            want = frames[:, :, 0]
        assert got.numel() == want.numel()
        assert (got - want.reshape(got.shape)).abs().max().item() < 1e-6
        if "image_grid_thw" in ref:  # its grid of patches; ours is of tokens (2 x 2 patches)
            t, gh, gw = ref["image_grid_thw"][0].tolist()
            assert grid == (t, gh // 2, gw // 2) and tokens == t * gh * gw // 4
        else:
            assert got.shape == (3, 28, 28) and grid is None


def test_greedy_and_logits_match_transformers(engine, hf):
    processor, model = hf
    pics = [picture(w, h, 10 + k) for k, (w, h) in enumerate(SIZES)]
    chats = [chat("describe it", pics[:1]), chat("compare these two", pics[:2], image_first=False),
             chat("three", pics), [{"role": "user", "content": "plain text"}]]
    images = [pics[:1], pics[:2], pics, []]
    max_new = 8
    sp = SamplingParams(max_new_tokens=max_new, min_new_tokens=max_new, temperature=0)
    out = engine.generate(messages=chats, sampling_params=sp)
    max_diff = 0.0
    for c, ims, item in zip(chats, images, out):
        inputs = hf_inputs(processor, c, ims)
        with torch.no_grad():
            ref = model.generate(**inputs, max_new_tokens=max_new, min_new_tokens=max_new,
                                 do_sample=False, pad_token_id=0)
            seq = ref[:, :-1]  # teacher-forced over prompt + all but the last new token
            n = inputs["input_ids"].shape[1]
            extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
            if "mm_token_type_ids" in extra:  # Qwen2-VL's, per token: the new ones are text
                types = extra["mm_token_type_ids"]
                extra["mm_token_type_ids"] = F.pad(types, (0, seq.shape[1] - n))
            ref_logits = model(input_ids=seq, **extra).logits[0, -max_new:]
        assert item.samples[0].token_ids == ref[0, n:].tolist()
        # Ours for the same positions, computed afresh (the cache flushed).
        ids, spans = engine.front.chats.encode(c)
        engine.flush_cache()
        [(start, logits)] = engine.prompt_logits([ids + item.samples[0].token_ids[:-1]], [spans])
        assert start == 0
        max_diff = max(max_diff, (logits[-max_new:] - ref_logits).abs().max().item())
    print(f"max logit diff {max_diff:.2e}")
    assert max_diff < LOGIT_TOL
    engine.check()


def test_an_image_cut_by_a_chunk_runs_the_tower_once(vlm):
    """Chunks cut images: the chunk after a cut takes the image's features from the one
    before, so each distinct image goes through the vision tower once."""
    # An odd chunk, so that chunks cut LLaVA's 4-token images too.
    engine = Engine(vlm, page_size=4, max_prefill_tokens=CHUNK[ModelConfig.from_dir(vlm).architecture] + 1)
    model = engine.runner.model
    tower = model.image_features
    computed, cut = [], []

    def counted(images):
        computed.extend(im.pad for im in images)
        return tower(images)

    features = model.features

    def watched(batch):
        cut.extend(batch.cut)
        return features(batch)

    model.image_features, model.features = counted, watched
    try:
        pics = [picture(w, h, 40 + k) for k, (w, h) in enumerate(SIZES * 3)]
        out = engine.generate(messages=[chat("all of them", pics)],
                              sampling_params=SamplingParams(max_new_tokens=2, temperature=0))
    finally:
        del model.image_features, model.features  # the class's again
    assert out[0].samples[0].finish_reason == "length"
    assert cut, "no chunk cut an image: the test shows nothing"
    assert sorted(computed) == sorted(set(computed)) and len(computed) == len(pics)
    assert not model.carried  # nothing cut at the end: nothing kept


def test_a_big_image_batch_holds_a_window_of_images(vlm):
    """An image budget that one small image's decoding fits, but not one preprocessed
    image: images are loaded a slice at a time (two in flight), so the requests in the
    engine hold a few slices' images, never the batch's; the tokens are those of an engine
    with the default budget."""
    from worker.engine.intake import MAX_LOADING, SLICE
    chats = [chat(f"item {k}", [picture(20 + k, 30, 70 + k)]) for k in range(3 * SLICE + 3)]
    sp = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)  # live a while
    ref = Engine(vlm, page_size=4).generate(messages=chats, sampling_params=sp)
    eng = Engine(vlm, page_size=4, image_memory=16_000)
    most, done = 0, {}
    for ev in eng.generate(messages=chats, sampling_params=sp, stream=True):
        most = max(most, len({id(s.image) for r in eng.front.intake.live if not r.finished for s in r.images}))
        if ev.finished:
            done[ev.index] = ev.token_ids
    assert 0 < most <= MAX_LOADING * SLICE < len(chats)
    assert [done[k] for k in range(len(chats))] == [it.samples[0].token_ids for it in ref]
    assert len(eng.front.intake) == 0 and eng.front.intake.held() == 0
    eng.check()


def test_positions_match_transformers(engine, hf):
    """A prompt's positions (Qwen2-VL: M-RoPE's three rows) are transformers', however a
    chunk boundary splits it; the tokens after it continue in one row."""
    processor, model = hf
    pics = [picture(w, h, 20 + k) for k, (w, h) in enumerate(SIZES)]
    c = chat("where", pics, image_first=False)
    ids, spans = engine.front.chats.encode(c)
    n = len(ids)
    if hasattr(model.model, "get_rope_index"):
        inputs = hf_inputs(processor, c, pics)
        ref, delta = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                inputs["image_grid_thw"])
        ref, delta = ref[:, 0].tolist(), delta.item()
        assert delta < 0
    else:
        ref, delta = [list(range(n))] * 3, 0
    req = Req("r", ids, SamplingParams(), 0, images=spans)

    def rows(p):
        return [list(p)] * 3 if isinstance(p, range) else list(p)

    for cut in range(n + 1):
        parts = zip(rows(req.positions(0, cut)), rows(req.positions(cut, n)))
        assert [a + b for a, b in parts] == ref
    assert req.positions(n, n + 3) == range(n + delta, n + 3 + delta)


def test_prefix_cache_keys_images_by_content(vlm):
    eng = Engine(vlm, page_size=4)
    sp = SamplingParams(max_new_tokens=4, temperature=0)
    a, b = picture(40, 30, 1), picture(40, 30, 2)  # same size: same token count and positions
    text = "what is in this picture? answer at length please"
    first = eng.generate(messages=[chat(text, [a])], sampling_params=sp)[0].samples[0]
    again = eng.generate(messages=[chat(text, [a])], sampling_params=sp)[0].samples[0]
    other = eng.generate(messages=[chat(text, [b])], sampling_params=sp)[0].samples[0]
    ids, spans = eng.front.chats.encode(chat(text, [a]))
    image_end = spans[0].start + spans[0].length
    print(f"prompt {len(ids)} tokens, image at [{spans[0].start}, {image_end}); cached: "
          f"first {first.usage.cached_tokens}, same image {again.usage.cached_tokens}, "
          f"other image {other.usage.cached_tokens}")
    assert first.usage.cached_tokens == 0
    assert again.usage.cached_tokens > image_end  # the image and the text after it
    assert again.token_ids == first.token_ids
    assert other.usage.cached_tokens <= spans[0].start  # only the text before the image
    # n > 1: the samples share one prefill (a warm-up) and get the greedy tokens.
    warm = eng.front.warmup_count
    sp2 = SamplingParams(max_new_tokens=4, temperature=0, n=2)
    two = eng.generate(messages=[chat("another question", [b])], sampling_params=sp2)[0]
    one = eng.generate(messages=[chat("another question", [b])], sampling_params=sp)[0]
    assert eng.front.warmup_count == warm + 1
    assert [s.token_ids for s in two.samples] == [one.samples[0].token_ids] * 2
    assert all(s.usage.cached_tokens > image_end for s in two.samples)
    eng.check()


def test_bad_items_fail_alone(vlm):
    eng = Engine(vlm, page_size=4)
    sp = SamplingParams(max_new_tokens=3, temperature=0)
    good = chat("fine", [picture(30, 30, 3)])
    not_image = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                            + base64.b64encode(b"not a picture").decode()}},
        {"type": "text", "text": "hm"}]}]
    remote = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]
    too_long = chat("many", [picture(28, 28, 4)] * 65)  # 65 * 4 image tokens > 256 context
    wordy = chat("word " * 300, [picture(28, 28, 5)])  # the image fits, the text does not
    out = eng.generate(messages=[good, not_image, remote, too_long, wordy], sampling_params=sp)
    assert out[0].samples[0].finish_reason == "length" and len(out[0].samples[0].token_ids) == 3
    errors = [it.samples[0].error for it in out[1:]]
    assert [it.samples[0].finish_reason for it in out[1:]] == ["error"] * 4
    assert "messages[1]: image 0: not a decodable PNG, JPEG or WebP image" in errors[0]
    assert "https: image URLs are not taken by this worker" in errors[1]
    # Refused from the images' headers, before any is decoded.
    assert errors[2] == "messages[3]: its images take 260 tokens; the model's context is 256 " \
        "(they were not decoded)", errors[2]
    assert "(1 images expanded); the model's context is 256" in errors[3], errors[3]
    eng.check()


def test_qwen2_vl_checkpoint_layouts():
    """transformers 4's config.json (text fields at the top level, rope_scaling of type
    "mrope") reads as transformers 5's does; both weight layouts map onto ours; an unknown
    vision tower is refused by name."""
    from worker.engine.models.registry import architecture

    raw = {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
           "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
           "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
           "max_position_embeddings": 32768, "rope_theta": 1000000.0, "sliding_window": 32768,
           "use_sliding_window": False, "tie_word_embeddings": True, "image_token_id": 151655,
           "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
           "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16,
                             "in_chans": 3, "hidden_size": 1536, "patch_size": 14,
                             "spatial_merge_size": 2, "temporal_patch_size": 2}}
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.mrope_section, cfg.rope_scaling, cfg.rope_theta) == ((16, 24, 24), None, 1e6)
    assert cfg.tie_word_embeddings and cfg.max_context == 32768 and cfg.head_dim == 128
    assert (cfg.vision.depth, cfg.vision.out_size, cfg.vision.image_token_id) == (32, 1536, 151655)
    arch = architecture(cfg.architecture)
    for theirs, ours in [("model.visual.merger.ln_q.weight", "visual.merger.ln_q.weight"),
                         ("visual.merger.ln_q.weight", "visual.merger.ln_q.weight"),
                         ("model.language_model.norm.weight", "language_model.norm.weight"),
                         ("model.norm.weight", "language_model.norm.weight"),
                         ("lm_head.weight", "language_model.lm_head.weight")]:
        assert arch.rename(theirs) == ours
    with pytest.raises(ValueError, match="vision_config.model_type 'siglip_vision_model'"):
        ModelConfig.from_dict({**raw, "vision_config": {"model_type": "siglip_vision_model"}})


def test_qwen2_5_vl_config_reads_as_transformers():
    """The Hub's Qwen2.5-VL config.json (transformers 4's layout: text fields at the top level,
    vision_config without a model_type) reads as transformers reads it."""
    from transformers import Qwen2_5_VLConfig

    raw = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
           "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
           "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 151936,
           "max_position_embeddings": 128000, "rope_theta": 1000000.0,
           "tie_word_embeddings": True, "image_token_id": 151655,
           "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
           "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280,
                             "intermediate_size": 3420, "num_heads": 16, "in_chans": 3,
                             "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2,
                             "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                             "temporal_patch_size": 2}}
    cfg, ref = ModelConfig.from_dict(raw), Qwen2_5_VLConfig(**raw)
    v, rv = cfg.vision, ref.vision_config
    assert (v.embed_dim, v.out_size, v.depth, v.num_heads, v.intermediate_size, v.hidden_act,
            v.window_size, v.full_blocks) == (
        rv.hidden_size, rv.out_hidden_size, rv.depth, rv.num_heads, rv.intermediate_size,
        rv.hidden_act, rv.window_size, tuple(rv.fullatt_block_indexes))
    t, rope = ref.text_config, ref.text_config.rope_parameters
    assert (cfg.hidden_size, cfg.num_layers, cfg.max_context, cfg.rope_theta,
            cfg.mrope_section) == (t.hidden_size, t.num_hidden_layers, t.max_position_embeddings,
                                   rope["rope_theta"], tuple(rope["mrope_section"]))
    assert cfg.tie_word_embeddings and ref.tie_word_embeddings


@pytest.mark.parametrize("vlm", ["qwen2_5_vl"], indirect=True)
def test_qwen2_5_vl_windows_match_transformers(vlm, hf):
    """Qwen2.5-VL's vision encoder equals transformers' on images of several windows, some cut
    short at the edges; the tiny model has both windowed and full-attention blocks."""
    from worker.engine.models.loader import load_model

    _, model = hf
    ours, cfg = load_model(vlm)
    assert 0 < len(cfg.vision.full_blocks) < cfg.vision.depth
    processor = image_processor(vlm, cfg.vision)
    for k, (w, h) in enumerate([(100, 75), (300, 41), (600, 400)]):
        pixels, _, (t, gh, gw) = processor(picture(w, h, 30 + k))
        _, windows = ours.visual.windows([(t, gh, gw)])
        assert len(windows) > 1 and len(set(windows)) > 1  # whole windows and cut ones
        with torch.no_grad():
            got = ours.visual(pixels, [(t, gh, gw)])
            grid = torch.tensor([[t, 2 * gh, 2 * gw]])  # transformers' grid is of patches
            ref = model.model.get_image_features(repeat_frames(pixels, cfg.vision.temporal_patch_size),
                                                 grid).pooler_output[0]
        assert (got - ref).abs().max().item() < 1e-5


def test_text_only_parts_are_one_string(tmp_path):
    """A message of text parts only reaches the template as one string: a text model's
    template prints a list as it is."""
    from worker.engine.chat import ChatEncoder
    from worker.engine.models.loader import load_tokenizer
    from worker.engine.models.tiny import build_tiny_model

    chats = ChatEncoder(load_tokenizer(build_tiny_model(str(tmp_path / "llama"))), None)
    parts = [{"role": "user", "content": [{"type": "text", "text": "red "}, {"type": "text", "text": "fox"}]}]
    assert chats.encode(parts) == chats.encode([{"role": "user", "content": "red fox"}])
    with pytest.raises(ValueError, match="message 0: a text part needs a text string"):
        chats.encode([{"role": "user", "content": [{"type": "text", "text": 5}]}])
