"""A full disk under the local blob store: the API process runs with a 1 MiB tmpfs mounted on
its store's folder (in a user and mount namespace of its own, `unshare -rm`; the worker joins
it with nsenter), which the test reads through /proc/PID/root. Uploads that do not fit get `503 store_unavailable` with
Retry-After and leave no temporary file; reads go on; a batch whose output files cannot be
written stays `finalizing` and says why in `errors`; once space is freed both go through.
Before: a writer's cleanup flushed into the full disk again and raised past every handler
(`500`s on POST /v1/files and GET /v1/batches/{id}, orphan `.part` files); here the batch
never left `in_progress`."""
import json
import os
import subprocess
import time

import openai
import pytest

from conftest import WorkerProc, start_api
from cli.redis_server import EmbeddedRedis
from test_openai_batch import chat_line, jsonl, read_lines, wait

SIZE = 1 << 20  # the tmpfs under the blob store


def userns_ok() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not userns_ok(), reason="needs `unshare -rm` (user namespaces) for a tmpfs of its own")
def test_a_full_disk_under_the_store_is_a_503_and_no_orphan_and_a_waiting_batch(model_dir, tmp_path):
    server = EmbeddedRedis()
    store = tmp_path / "blobs"
    store.mkdir()
    env = {"FANOUT_STORAGE_URL": f"file://{store}"}
    mount = ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size={SIZE} tmpfs "$0" && exec "$@"', str(store)]
    api, url = start_api(server.url, tmp_path, "api", env=env, wrap=mount)
    pid = api.proc.pid  # unshare and sh exec the API: the same process
    # The worker reads the batch's items from the same store: it joins the API's namespaces.
    worker = WorkerProc(server.url, model_dir, tmp_path, env=env,
                        wrap=["nsenter", "-t", str(pid), "-U", "-m", "--preserve-credentials"])
    seen = f"/proc/{pid}/root{store}"  # the store as they see it: the tmpfs

    def parts() -> list[str]:
        return [f for _, _, names in os.walk(seen) for f in names if f.endswith(".part")]

    def free() -> int:
        st = os.statvfs(seen)
        return st.f_bavail * st.f_frsize

    try:
        assert free() <= SIZE  # the tmpfs, not the folder beneath it
        worker.start()
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60) as oai:
            lines = [chat_line(f"q{i}", f"question {i}", max_tokens=200, temperature=0, ignore_eos=True)
                     for i in range(4)]
            batch_input = oai.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")

            def rows(n: int) -> bytes:
                return "".join(json.dumps({"prompt": "x" * 90}) + "\n" for _ in range(n)).encode()

            # A dataset file that leaves ~8 KB: less than the batch's output needs.
            filler = oai.files.create(file=("fill.jsonl", rows((free() - 8192) // 105)), purpose="dataset")
            with pytest.raises(openai.InternalServerError) as e:  # 503: does not fit
                oai.files.create(file=("more.jsonl", rows(200)), purpose="dataset")
            assert e.value.status_code == 503 and e.value.code == "store_unavailable", e.value
            assert e.value.response.headers["Retry-After"] == "5"
            assert parts() == []  # the partial upload is gone at once
            assert oai.files.retrieve(filler.id).bytes > 0 and len(oai.files.list().data) == 2  # reads go on

            b = oai.batches.create(input_file_id=batch_input.id, endpoint="/v1/chat/completions",
                                   completion_window="24h")
            b = wait(oai, b.id, ("finalizing", "completed", "failed"))
            t = time.monotonic()
            while time.monotonic() - t < 3:  # every look at it answers, and says why it waits
                b = oai.batches.retrieve(b.id)
                assert b.status == "finalizing" and b.errors.data[0].code == "store_unavailable", (b.status, b.errors)
                time.sleep(0.5)
            assert parts() == []

            oai.files.delete(filler.id)  # space freed: the next sweep writes the files
            b = wait(oai, b.id, ("completed",), timeout=30)
            assert b.errors is None and b.request_counts.completed == 4, b
            assert [x["custom_id"] for x in read_lines(oai, b.output_file_id)] == [x["custom_id"] for x in lines]
            assert oai.files.create(file=("more.jsonl", rows(200)), purpose="dataset").bytes > 0
            assert parts() == []
    finally:
        worker.stop()
        api.stop()
        server.stop()
