"""LLaVA image input: preprocessing, logits and greedy tokens against transformers (its own
processor and LlavaForConditionalGeneration), the prefix cache keyed by image content, and
per-item failures."""
import base64
import io

import pytest
import torch
from PIL import Image as PILImage

from worker.engine import Engine, SamplingParams
from worker.engine.images import ImageProcessor, decode_data_url
from worker.engine.models.tiny import build_tiny_llava

LOGIT_TOL = 5e-4  # fp32, max abs difference, as tests/test_engine.py
SIZES = [(40, 28), (28, 61), (100, 75)]  # (width, height): resized and cropped differently


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    # Shortest edge 32, crop 28: resizing and cropping both do something.
    return build_tiny_llava(str(tmp_path_factory.mktemp("llava") / "m"), shortest_edge=32,
                            max_context=256)


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
def hf(llava):
    from transformers import AutoProcessor, LlavaForConditionalGeneration
    return (AutoProcessor.from_pretrained(llava),
            LlavaForConditionalGeneration.from_pretrained(llava, dtype=torch.float32).eval())


@pytest.fixture(scope="module")
def engine(llava):
    return Engine(llava, page_size=4, max_prefill_tokens=24)  # an image is 4 tokens: chunks split them


def test_preprocessing_matches_transformers(llava, hf):
    processor, _ = hf
    ours = ImageProcessor.from_dir(llava)
    for k, (w, h) in enumerate(SIZES + [(28, 28), (300, 41)]):
        img = decode_data_url(data_url(picture(w, h, k), "WEBP" if k % 2 else "PNG"))
        ref = processor.image_processor(img, return_tensors="pt")["pixel_values"][0]
        got = ours(img)
        assert got.shape == ref.shape == (3, 28, 28)
        assert (got - ref).abs().max().item() < 1e-6


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
            pixels = inputs.get("pixel_values")
            ref_logits = model(input_ids=seq, pixel_values=pixels).logits[0, -max_new:]
        n = inputs["input_ids"].shape[1]
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


def test_prefix_cache_keys_images_by_content(llava):
    eng = Engine(llava, page_size=4)
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


def test_bad_items_fail_alone(llava):
    eng = Engine(llava, page_size=4)
    sp = SamplingParams(max_new_tokens=3, temperature=0)
    good = chat("fine", [picture(30, 30, 3)])
    not_image = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                            + base64.b64encode(b"not a picture").decode()}},
        {"type": "text", "text": "hm"}]}]
    remote = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]
    too_long = chat("many", [picture(28, 28, 4)] * 65)  # 65 * 4 image tokens > 256 context
    out = eng.generate(messages=[good, not_image, remote, too_long], sampling_params=sp)
    assert out[0].samples[0].finish_reason == "length" and len(out[0].samples[0].token_ids) == 3
    errors = [it.samples[0].error for it in out[1:]]
    assert [it.samples[0].finish_reason for it in out[1:]] == ["error"] * 3
    assert "messages[1]: image 0: not a decodable PNG, JPEG or WebP image" in errors[0]
    assert "only data:image/...;base64 URLs" in errors[1]
    assert "65 images expanded" in errors[2] and "context is 256" in errors[2]
    eng.check()



def test_text_only_parts_are_one_string(tmp_path):
    """A message of text parts only reaches the template as one string: a text model's
    template prints a list as it is."""
    from worker.engine.chat import ChatEncoder
    from worker.engine.models.loader import load_tokenizer
    from worker.engine.models.tiny import build_tiny_model

    chats = ChatEncoder(load_tokenizer(build_tiny_model(str(tmp_path / "llama"))), None)
    parts = [{"role": "user", "content": [{"type": "text", "text": "red "}, {"type": "text", "text": "fox"}]}]
    assert chats.encode(parts) == chats.encode([{"role": "user", "content": "red fox"}])
