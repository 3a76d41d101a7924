"""The dashboard's pages against a real agent (in process): what they show,
and how they honour tokens (cookie sign-in, run patterns, 401/403/404)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from devsupport.agent import (
    posix_region,
    running_agent,
    token_entry,
    write_checkpoint,
)


async def test_pages_show_runs_regions_lineage_and_failures(
    catalog_url: str, tmp_path: Path
) -> None:
    west = tmp_path / "west"
    regions = [posix_region("east", tmp_path / "east"), posix_region("west", west)]
    async with running_agent(catalog_url, tmp_path, regions) as agent:
        empty = await agent.http.get("/ui")
        assert empty.status_code == 200 and "no runs yet" in empty.text

        first = write_checkpoint(agent.ssd / "a1", {"w.bin": 1000})
        assert (await agent.register("alpha", 1, first)).status_code == 202
        await agent.wait_state("alpha", 1, ("replicated",))
        # West breaks: the next checkpoint is durable in east only.
        shutil.rmtree(west)
        west.write_text("not a directory")
        second = write_checkpoint(agent.ssd / "a2", {"w.bin": 2000})
        parent = {"run": "alpha", "step": 1}
        assert (await agent.register("alpha", 2, second, parent=parent)).status_code == 202
        fork = write_checkpoint(agent.ssd / "b1", {"w.bin": 10})
        parent = {"run": "alpha", "step": 2}
        assert (await agent.register("beta", 5, fork, parent=parent)).status_code == 202
        await agent.wait_state("alpha", 2, ("durable",))
        for _ in range(200):
            detail = (await agent.http.get("/v1/runs/alpha/checkpoints/2")).json()
            if any(j["kind"] == "replicate" and j["last_error"] for j in detail["jobs"]):
                break
            import asyncio

            await asyncio.sleep(0.05)

        index = await agent.http.get("/ui")
        assert index.status_code == 200
        assert index.headers["content-type"].startswith("text/html")
        assert "script-src" not in index.headers["content-security-policy"]  # no JS at all
        row = re.search(r'<tr data-run="alpha">(.*?)</tr>', index.text, re.S)
        assert row is not None
        assert "step 2" in row.group(1) and "step 1" in row.group(1)  # east ahead of west

        page = await agent.http.get("/ui/runs/alpha")
        assert page.status_code == 200
        html = page.text
        assert '<span id="run-name">alpha</span>' in html
        assert '<div class="value" id="latest-valid">2</div>' in html
        assert 'data-region="west" data-state="pending"' in html
        assert 'data-region="west" data-step="1" data-state="committed"' in html  # timeline
        assert 'id="failures"' in html and "replicate" in html
        assert 'data-run="beta" data-step="5"' in html  # the fork, in the lineage graph
        assert (await agent.http.get("/ui/runs/nope")).status_code == 404

        refreshing = await agent.http.get("/ui", params={"refresh": "10"})
        assert '<meta http-equiv="refresh" content="10">' in refreshing.text


async def test_tokens_cookie_sign_in_and_run_patterns(catalog_url: str, tmp_path: Path) -> None:
    tokens = [
        token_entry("admin", "admin-token", "admin"),
        token_entry("llama-reader", "llama-token", "reader", runs="llama-*"),
    ]
    async with running_agent(catalog_url, tmp_path, tokens=tokens) as agent:
        for run in ("llama-7b", "secret"):
            ckpt = write_checkpoint(agent.ssd / run, {"w": b"w"})
            answer = await agent.http.post(
                "/v1/checkpoints",
                json={"run": run, "step": 1, "path": str(ckpt)},
                headers={"Authorization": "Bearer admin-token"},
            )
            assert answer.status_code == 202

        anonymous = await agent.http.get("/ui")
        assert anonymous.status_code == 401
        assert 'name="token"' in anonymous.text and "llama-7b" not in anonymous.text

        wrong = await agent.http.get("/ui", params={"token": "guess"})
        assert wrong.status_code == 401 and "not valid" in wrong.text

        signed = await agent.http.get(
            "/ui/runs/llama-7b", params={"token": "llama-token", "x": "1"}
        )
        assert signed.status_code == 303
        assert signed.headers["location"] == "/ui/runs/llama-7b?x=1"  # token dropped
        cookie = signed.headers["set-cookie"]
        assert "tierckpt_ui=llama-token" in cookie and "HttpOnly" in cookie
        assert "Path=/ui" in cookie and "SameSite=strict" in cookie

        agent.http.cookies.set("tierckpt_ui", "llama-token", path="/ui")
        index = await agent.http.get("/ui")
        assert index.status_code == 200
        assert 'data-run="llama-7b"' in index.text and "secret" not in index.text
        assert (await agent.http.get("/ui/runs/llama-7b")).status_code == 200
        assert (await agent.http.get("/ui/runs/secret")).status_code == 403
        agent.http.cookies.clear()

        bearer = await agent.http.get("/ui", headers={"Authorization": "Bearer admin-token"})
        assert bearer.status_code == 200 and 'data-run="secret"' in bearer.text

        out = await agent.http.get("/ui/logout")
        assert out.status_code == 303 and 'tierckpt_ui=""' in out.headers["set-cookie"]
