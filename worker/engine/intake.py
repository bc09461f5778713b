"""Items on their way into the engine, prepared on threads of their own so the steps of the
requests already in the engine go on meanwhile (the front fans them out once ready).

TextIntake: texts and chats without images are tokenized (a chat templated first) on one
thread, with its own copy of the tokenizer (encoder.py), a slice at a time: a shard of long
prompts does not hold the engine's loop, which keeps heartbeating and reading cancels.

ImageIntake: chat items with images. Their images are read (files, downloads: image_urls.py), decoded and preprocessed
(images.py) on threads of their own, a few items at a time, so the steps of the requests
already in the engine go on meanwhile. And only while the preprocessed images that live
requests hold stay under a budget: a job of 10,000 images holds a window of them, not all
(a LLaVA-1.5 image is 1.4 MB of pixels, a 1-megapixel photo about 12 MB for Qwen2-VL). The
front encodes a loaded item's chat (template, tokens) on the engine's thread and adds its
requests.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable

from .chat import ChatEncoder
from .req import Req
from .sampling_params import SamplingParams

SLICE = 8  # items loaded together (their distinct URLs read at once)
TEXT_SLICE = 16  # items tokenized together
MAX_LOADING = 2  # slices in flight: the budget may be passed by at most these
WAIT_S = 0.05  # how long a step with nothing else to do waits for a slice


@dataclass(slots=True, frozen=True)
class Call:
    """One Front.add() call: what its items share."""
    tag: object  # the caller's handle: events carry it, abort names it
    owner: object  # whose share of the engine its requests count against (scheduler.py)
    group: int  # its rids' prefix
    seed: int  # the job seed
    sink: Callable | None
    lora: int = 0  # the LoRA adapter's slot its requests run under (lora.py); 0: the base model


@dataclass(slots=True)
class Pending:
    """An item on its way (what Front.add needs to fan it out later)."""
    call: Call
    index: int
    chat: list | str  # a chat, or a text (TextIntake)
    params: SamplingParams


class _Slices:
    """Slices of items in flight on a pool, each with its future."""

    def __init__(self):
        self.loading: list[tuple[Future, list[Pending]]] = []

    def _done(self, block: bool) -> list[tuple[list[Pending], object]]:
        """The slices whose futures are done (`block`: wait a little for one first), each
        with its result or the exception it raised."""
        if block and self.loading and not any(f.done() for f, _ in self.loading):
            wait([f for f, _ in self.loading], timeout=WAIT_S, return_when=FIRST_COMPLETED)
        done, running = [], []
        for x in self.loading:  # each future looked at once: it may finish meanwhile
            (done if x[0].done() else running).append(x)
        self.loading = running
        return [(items, _result(f)) for f, items in done]

    def _drop_loading(self, tag: object) -> list[Pending]:
        """Forget tag's items in flight (an abort); the slice still runs, its other items kept."""
        gone = []
        for k, (f, items) in enumerate(self.loading):
            gone += [p for p in items if p.call.tag == tag]
            self.loading[k] = (f, [p for p in items if p.call.tag != tag])
        return gone


class TextIntake(_Slices):
    def __init__(self, encode: Callable[[list[tuple]], list[tuple]]):
        super().__init__()
        self.encode = encode  # Encoder.encode of the thread's own encoder
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    def __len__(self) -> int:
        return sum(len(items) for _, items in self.loading)

    def put(self, items: list[Pending]) -> None:
        """One add() call's items: a slice never mixes calls, so an abort (one tag) drops a
        slice whole and the encoded results stay aligned with the items left."""
        for i in range(0, len(items), TEXT_SLICE):
            part = items[i:i + TEXT_SLICE]
            self.loading.append((self.pool.submit(self.encode, [(p.index, p.chat, None, p.params) for p in part]), part))

    def owners(self) -> set:
        """The owners of the items being tokenized."""
        return {items[0].call.owner for _, items in self.loading if items}

    def ready(self, block: bool) -> list[tuple[list[Pending], list | Exception]]:
        """The encoded slices: (items, (ids, image spans, error) per item, or an exception)."""
        return self._done(block)

    def drop(self, tag: object) -> list[Pending]:
        return self._drop_loading(tag)


class ImageIntake(_Slices):
    def __init__(self, chats: ChatEncoder, max_tokens: int, budget: int, threads: int = 2):
        self.chats = chats
        self.max_tokens = max_tokens  # the context: a chat whose images pass it is not decoded
        self.budget = budget  # bytes of preprocessed images that live requests may hold
        super().__init__()
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="images")
        self.queue: deque[Pending] = deque()
        self.live: list[Req] = []  # requests holding preprocessed images

    def __len__(self) -> int:
        """Items not yet handed back by ready()."""
        return len(self.queue) + sum(len(items) for _, items in self.loading)

    def put(self, items: list[Pending]) -> None:
        self.queue.extend(items)

    def hold(self, reqs: list[Req]) -> None:
        """Count these requests' images against the budget until they finish."""
        self.live.extend(r for r in reqs if r.images)

    def held(self) -> int:
        """Bytes of the distinct images that unfinished requests hold."""
        images = {id(s.image): s.image.pixels for r in self.live if not r.finished for s in r.images}
        return sum(p.numel() * p.element_size() for p in images.values())

    def ready(self, block: bool) -> list[tuple[list[Pending], dict | Exception]]:
        """The slices whose images are loaded, each with its images (url -> Image or
        ImageError; an exception if loading failed); starts loading more while the budget
        allows. With `block` (nothing else to do), waits a little for a slice in flight."""
        # Finished requests let their images go here, not only when more items wait.
        self.live = [r for r in self.live if not r.finished]
        if self.queue and len(self.loading) < MAX_LOADING:
            held = self.held()
            while self.queue and len(self.loading) < MAX_LOADING and (held < self.budget or not
                                                                      (self.live or self.loading)):
                items = [self.queue.popleft() for _ in range(min(SLICE, len(self.queue)))]
                chats = [p.chat for p in items]
                self.loading.append((self.pool.submit(self.chats.load, chats, self.max_tokens), items))
        return self._done(block)

    def drop(self, tag: object) -> list[Pending]:
        """Forget tag's items (an abort); a slice in flight is still loaded, its other
        items kept."""
        gone = [p for p in self.queue if p.call.tag == tag]
        self.queue = deque(p for p in self.queue if p.call.tag != tag)
        return gone + self._drop_loading(tag)


def _result(f: Future):
    """The slice's result, or what made preparing it fail (its items fail with it)."""
    try:
        return f.result()
    except Exception as e:
        return e
