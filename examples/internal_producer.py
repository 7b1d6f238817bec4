"""An internal producer: a service on the bus that calls the OpenAI API over NATS.

Its calls pass the same admission as HTTP ones (the tenant's API key, quotas, priority band) and
are billed to the tenant. With a platform running (`make up`):

    python examples/internal_producer.py --api-key sk-... "Write a haiku about queues."
"""

from __future__ import annotations

import argparse
import asyncio
import os

import nats

from inferbus.bus.client import BusAPIError, BusClient


async def main(args: argparse.Namespace) -> int:
    nc = await nats.connect(args.nats_url)
    api = BusClient(nc, args.api_key)
    messages = [{"role": "user", "content": args.prompt}]
    try:
        if args.stream:
            async for chunk in api.stream_chat_completion(
                model=args.model, messages=messages, max_tokens=args.max_tokens
            ):
                if chunk["choices"]:
                    print(chunk["choices"][0]["delta"].get("content") or "", end="", flush=True)
            print()
        else:
            answer = await api.chat_completion(model=args.model, messages=messages, max_tokens=args.max_tokens)
            print(answer["choices"][0]["message"]["content"])
            print(f"[{answer['usage']['total_tokens']} tokens billed to the key's tenant]")
    except BusAPIError as error:
        print(f"refused ({error.status}, {error.code}): {error.error.get('message')}")
        return 1
    finally:
        await nc.close()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", help="the user message")
    parser.add_argument("--nats-url", default=os.environ.get("NATS_URL", "nats://127.0.0.1:4222"),
                        help="the platform's NATS (default: $NATS_URL or nats://127.0.0.1:4222)")
    parser.add_argument("--api-key", default=os.environ.get("INFERBUS_API_KEY", ""),
                        help="a tenant's API key (default: $INFERBUS_API_KEY)")
    parser.add_argument("--model", default=os.environ.get("INFERBUS_MODEL", "meta-llama/Llama-3.3-70B-Instruct"))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--no-stream", dest="stream", action="store_false", help="one answer instead of chunks")
    raise SystemExit(asyncio.run(main(parser.parse_args())))
