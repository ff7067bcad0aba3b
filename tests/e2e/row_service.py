"""A long-lived agent service for the rows_from_service end-to-end test: it posts the rows of a data file to
``POST /sessions`` (several at once), runs every episode of each group it gets (one completion with the official
openai package), reports the completion as the episode's answer, and appends what it saw as JSON lines to a file.

Usage: python row_service.py PORT ROWS.jsonl LOG.jsonl  (the key in $MEGARL_AGENT_SERVICE_KEY); it runs until it
is stopped."""
import asyncio
import json
import os
import sys

import aiohttp
import openai

PORT, ROWS, LOG = int(sys.argv[1]), sys.argv[2], sys.argv[3]
KEY = os.environ["MEGARL_AGENT_SERVICE_KEY"]
URL = f"http://127.0.0.1:{PORT}/sessions"


def log(record: dict) -> None:
    with open(LOG, "a") as f:
        f.write(json.dumps(record) + "\n")


async def episode(http: aiohttp.ClientSession, session: dict, row: dict) -> None:
    try:
        async with openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["key"]) as oa:
            model = (await oa.models.list()).data[0].id  # the id megarl serves
            reply = await oa.chat.completions.create(model=model, messages=[{"role": "user", "content": row["prompt"]}])
        outcome = {"answer": reply.choices[0].message.content}
    except openai.APIError as e:  # e.g. the run ended meanwhile: the episode gets reward 0
        log({"completion_error": str(e)})
        outcome = {"reward": 0.0}
    try:
        async with http.post(f"{URL}/{session['key']}/reward", json=outcome) as r:
            log({"reward_status": r.status})
    except aiohttp.ClientConnectionError:
        log({"reward_status": None})


async def worker(http: aiohttp.ClientSession, rows: list[dict], start: int, step: int) -> None:
    k = start
    while True:
        row = rows[k % len(rows)]
        try:
            async with http.post(URL, json={"row": row}, headers={"Authorization": f"Bearer {KEY}"}) as r:
                status, body, retry = r.status, await r.json(), r.headers.get("Retry-After")
        except aiohttp.ClientConnectionError:  # the run is not listening yet, or has ended
            await asyncio.sleep(0.2)
            continue
        log({"post_status": status, "row_id": row["id"], "group_id": body.get("group_id"),
             "n_sessions": len(body.get("sessions", ())), "error": body.get("error")})
        if status == 503:
            await asyncio.sleep(float(retry or 1))
            continue
        if status == 200:
            await asyncio.gather(*(episode(http, s, row) for s in body["sessions"]))
        k += step


async def main() -> None:
    with open(ROWS) as f:
        rows = [json.loads(x) for x in f if x.strip()]
    rows.insert(1, {"id": "bad", "question": "no prompt field"})  # refused with 400, naming data.prompt_key
    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(worker(http, rows, j, 3) for j in range(3)))


asyncio.run(main())
