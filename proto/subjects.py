"""Every subject, stream, consumer and bucket name on the bus. Build names here, nowhere else.

Layout (see DESIGN.md):
    inferbus.req.<band>.<model>.any | .w.<worker> .<gateway>   JetStream REQUESTS (work queue); the
                                                   last token names the gateway its replies go to
    inferbus.tok.<gateway>.<worker>                core NATS: stream events for that gateway's requests, by worker
    inferbus.cancel.<gateway>.<request_id>         core NATS: only that gateway may cancel (its NATS permissions)
    inferbus.requeue.batch-<id>                    core NATS request/reply: a worker hands a batch line back
    inferbus.usage.<tenant>.<w|o>.<sender>         JetStream USAGE (the billing ledger)
    inferbus.metrics.<worker> / inferbus.cache.<worker>
    inferbus.place.<model>                         router request/reply
    inferbus.placed.<model>                        core NATS: placements, shared by router replicas
    inferbus.control.<worker> / inferbus.scale.<pool>
    inferbus.batchres.<batch_id>.<w|o>.<sender>    JetStream BATCH_RESULTS: how each line of a batch ended
    inferbus.api.v1.chat.completions | .completions   internal producers' OpenAI calls (request/reply)
    inferbus.api.cancel.<gateway>.<call>           core NATS: a producer abandoning a streamed call
    inferbus.release.<model or adapter>            core NATS: canary decisions (ReleaseDecision)
    inferbus.prefill.<prefill worker>.<decode worker>   core NATS request/reply: a decode worker's prefill halves
    inferbus.prefilled.<decode worker>             core NATS: a prefill half ended (PrefillDone)

Token subjects name the gateway, not the request: each gateway holds one subscription instead of
subscribing and unsubscribing per request, and a worker sends the events of many requests bound
for one gateway (one engine step's tokens) as one message.
"""

from __future__ import annotations

import base64
from typing import Literal

from proto.bands import Band

PREFIX = "inferbus"

REQUESTS_STREAM = "REQUESTS"
USAGE_STREAM = "USAGE"
WORKERS_BUCKET = "workers"
MODELS_BUCKET = "models"
ADAPTERS_BUCKET = "adapters"
BATCH_RESULTS_STREAM = "BATCH_RESULTS"
BATCHES_BUCKET = "batches"  # one BatchRecord per batch, keyed `batch_key(tenant, batch_id)`
FILES_BUCKET = "files"  # one FileRecord per file, keyed `file_key(tenant, file_id)`
RESPONSES_BUCKET = "responses"  # one StoredResponse per stored response, keyed `response_key(tenant, id)`
CLAIMS_BUCKET = "claims"  # which worker runs each attempt of a request, keyed `claim_key(request_id, attempt)`
# Who dispatched each request: written by the gateway (or batch service) that queues it, keyed
# `dispatch_key(request_id)`; billing takes a worker's usage only for a request dispatched for its tenant.
DISPATCHES_BUCKET = "dispatches"

ANY_TARGET = "any"

_ESCAPES = {"%": "%25", ".": "%2E", "*": "%2A", ">": "%3E", " ": "%20", "\t": "%09", "\n": "%0A", "\r": "%0D"}


def token(name: str) -> str:
    """Make an arbitrary name (a model id such as `meta-llama/Llama-3.3-70B`) one subject token."""
    if not name:
        raise ValueError("subject tokens must not be empty")
    return "".join(_ESCAPES.get(ch, ch) for ch in name)


def worker_target(worker_id: str) -> str:
    return f"w.{token(worker_id)}"


def request_subject(band: Band, model: str, target: str, reply_to: str) -> str:
    """`target` is `ANY_TARGET` or `worker_target(worker_id)`; the last token is the owner of
    `reply_to` (the request's reply subject, `token_subject(owner)`: a gateway or batch service).
    A publisher's NATS permissions allow its own owner token only, and a worker runs a request only
    when its `reply_to` is that owner's (`request_reply_allowed`), so no identity can make a worker
    stream tokens to another gateway."""
    return f"{PREFIX}.req.{band}.{token(model)}.{target}.{reply_owner(reply_to)}"


def request_filter(band: Band, model: str, target: str = ANY_TARGET) -> str:
    """A consumer's filter: every owner's requests of `band` and `model` for `target`."""
    return f"{PREFIX}.req.{band}.{token(model)}.{target}.*"


def request_owner(subject: str) -> str:
    """The owner token of a request subject (its last token)."""
    return subject.rsplit(".", 1)[-1]


def request_reply_allowed(subject: str, reply_to: str) -> bool:
    """Whether a request that arrived on `subject` may stream to `reply_to`: only to the token
    subject of the owner its publisher was allowed to name."""
    return reply_to == f"{PREFIX}.tok.{request_owner(subject)}"


def shared_request_subject(worker_subject: str) -> str | None:
    """The shared (`any`) subject for a request queued on `worker_subject` (a worker's own queue,
    with its owner token), or None when the subject is not a worker's request subject."""
    head, sep, rest = worker_subject.rpartition(".w.")
    if not sep or not head.startswith(f"{PREFIX}.req.") or "." not in rest:
        return None
    return f"{head}.{ANY_TARGET}.{rest.split('.', 1)[1]}"


def worker_of_request_subject(subject: str) -> str | None:
    """The worker token of a worker's request subject or filter (as `token(worker_id)`), else None."""
    head, sep, rest = subject.rpartition(".w.")
    if not sep or not head.startswith(f"{PREFIX}.req.") or "." not in rest:
        return None
    return rest.split(".", 1)[0]


def shared_request_wildcard(band: Band | None = None, owner: str | None = None) -> str:
    """Shared (`any`) request subjects of `band` (of every band when None) and of `owner` (of
    every owner when None), for permissions."""
    return f"{PREFIX}.req.{band or '*'}.*.{ANY_TARGET}.{'*' if owner is None else token(owner)}"


def owned_request_wildcards(owner: str) -> tuple[str, str]:
    """Every request subject a publisher may use when its replies go to `owner`: the shared
    queue and every worker's own queue, of every band and model."""
    return (shared_request_wildcard(None, owner), f"{PREFIX}.req.*.*.w.*.{token(owner)}")


def requests_stream_subjects() -> list[str]:
    return [f"{PREFIX}.req.>"]


def request_consumer(band: Band, model: str, worker_id: str | None = None) -> str:
    """Durable consumer name: one per worker per band, plus one shared per band for `any`."""
    owner = "any" if worker_id is None else f"w_{worker_id}"
    return _durable(f"{band}_{token(model)}_{owner}")


def _durable(name: str) -> str:
    # Durable names may not contain '.', '*', '>', whitespace or path separators.
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)


def token_subject(gateway_id: str) -> str:
    return f"{PREFIX}.tok.{token(gateway_id)}"


def event_subject(reply_to: str, worker_id: str) -> str:
    """Where `worker_id` publishes the stream events of a request whose reply_to is `reply_to`
    (`inferbus.tok.<gateway>.<worker>`): NATS permissions bind the last token to the publisher."""
    return f"{reply_to}.{token(worker_id)}"


def event_filter(owner: str) -> str:
    """Every stream event for `owner`'s requests, whichever worker publishes it."""
    return f"{token_subject(owner)}.*"


def event_publish_wildcard(worker_id: str | None = None) -> str:
    """Stream events for any gateway, published as `worker_id` (as any worker with None)."""
    return f"{PREFIX}.tok.*.{'*' if worker_id is None else token(worker_id)}"


def event_sender(subject: str) -> str:
    """The worker token that published on an event subject ("" for a subject that names none)."""
    parts = subject.split(".")
    return parts[3] if len(parts) == 4 else ""


def cancel_subject(gateway_id: str, request_id: str) -> str:
    """Cancel a request of `gateway_id` (the gateway or batch service whose `token_subject` is the
    request's `reply_to`): a producer's NATS permissions allow its own cancel subjects only."""
    return f"{PREFIX}.cancel.{token(gateway_id)}.{token(request_id)}"


def cancel_subjects_of(gateway_id: str) -> str:
    """Every cancel subject of one gateway's requests (its NATS permission)."""
    return f"{PREFIX}.cancel.{token(gateway_id)}.*"


def resend_subject(worker_id: str, gateway_id: str) -> str:
    """Ask `worker_id` to send again events of a request of `gateway_id` (request/reply): a
    gateway's NATS permissions allow its own resend subjects only, and the worker resends only to
    that gateway's `token_subject`."""
    return f"{PREFIX}.resend.{token(worker_id)}.{token(gateway_id)}"


def resend_subjects_of(gateway_id: str) -> str:
    """Every worker's resend subject for one gateway's requests (its NATS permission)."""
    return f"{PREFIX}.resend.*.{token(gateway_id)}"


def resend_worker_subjects(worker_id: str) -> str:
    """One worker's resend subjects, for every gateway."""
    return f"{PREFIX}.resend.{token(worker_id)}.*"


def resend_wildcard() -> str:
    return f"{PREFIX}.resend.*.*"


def holder_subject(gateway_id: str) -> str:
    """Ask every worker at once to send again events of a request of `gateway_id` whose worker the
    gateway does not know (its `Accepted` lost with them); only the worker holding it answers."""
    return f"{PREFIX}.holder.{token(gateway_id)}"


def holder_wildcard() -> str:
    return f"{PREFIX}.holder.*"


def resend_owner(subject: str) -> str:
    """The gateway token of a resend or holder subject, to compare with `reply_owner` of the request."""
    return subject.rsplit(".", 1)[-1]


def cancel_wildcard() -> str:
    return f"{PREFIX}.cancel.*.*"


def requeue_subject(owner: str) -> str:
    """Where a worker hands a batch line back to the batch service that owns it (`owner`, the last
    token of the line's reply_to): the service queues the line's next attempt itself."""
    return f"{PREFIX}.requeue.{token(owner)}"


def requeue_wildcard() -> str:
    return f"{PREFIX}.requeue.*"


def cancel_owner(subject: str) -> str:
    """The gateway token of a cancel subject, to compare with `reply_owner` of the request."""
    return subject.split(".")[2] if subject.count(".") >= 3 else ""


def reply_owner(reply_to: str) -> str:
    """The gateway token of a request's `reply_to` (its gateway's token subject)."""
    return reply_to.rsplit(".", 1)[-1]


# Who reports a usage event, the subject's fourth token: a worker, of the attempts it ran, or the
# request's owner (a gateway), of requests no worker finished. With the sender's id after it, NATS
# permissions bind the subject to the identity that publishes it (docs/security.md).
USAGE_FROM_WORKER = "w"
USAGE_FROM_OWNER = "o"


def usage_subject(tenant: str, kind: str, sender: str) -> str:
    """`inferbus.usage.<tenant>.<w | o>.<sender>`: a usage event of `tenant`, reported by `sender`."""
    return f"{PREFIX}.usage.{token(tenant)}.{kind}.{token(sender)}"


def usage_filter(tenant: str) -> str:
    """Every usage event of `tenant`, whoever reported it (a consumer's filter)."""
    return f"{PREFIX}.usage.{token(tenant)}.>"


def usage_publish_wildcard(kind: str, sender: str | None = None) -> str:
    """Usage of any tenant, reported as `sender` (any sender of that kind with None)."""
    return f"{PREFIX}.usage.*.{kind}.{'*' if sender is None else token(sender)}"


def usage_sender(subject: str) -> tuple[str, str] | None:
    """(kind, sender token) of a usage subject; None for one that names no sender (written before
    senders were named)."""
    parts = subject.split(".")
    if len(parts) != 5:
        return None
    return parts[3], parts[4]


def attributed_usage_subject(subject: str, kind: str, sender: str) -> str:
    """`subject` naming `sender`: an outbox may still hold events stored under the older layout."""
    parts = subject.split(".")
    return subject if len(parts) != 3 else f"{subject}.{kind}.{token(sender)}"


def usage_stream_subjects() -> list[str]:
    return [f"{PREFIX}.usage.>"]


def metrics_subject(worker_id: str) -> str:
    return f"{PREFIX}.metrics.{token(worker_id)}"


def metrics_wildcard() -> str:
    return f"{PREFIX}.metrics.*"


def cache_subject(worker_id: str) -> str:
    return f"{PREFIX}.cache.{token(worker_id)}"


def placement_subject(model: str) -> str:
    return f"{PREFIX}.place.{token(model)}"


def placement_wildcard() -> str:
    return f"{PREFIX}.place.*"


def placed_subject(model: str) -> str:
    return f"{PREFIX}.placed.{token(model)}"


def placed_wildcard() -> str:
    return f"{PREFIX}.placed.*"


def cache_wildcard() -> str:
    return f"{PREFIX}.cache.*"


def control_subject(worker_id: str) -> str:
    return f"{PREFIX}.control.{token(worker_id)}"


def control_wildcard() -> str:
    return f"{PREFIX}.control.*"
def liveness_subject(worker_id: str) -> str:
    """A worker's liveness probe (request/reply), answered by its heartbeat thread."""
    return f"{PREFIX}.alive.{token(worker_id)}"


def liveness_wildcard() -> str:
    """Every worker's liveness probe subject (for permissions)."""
    return f"{PREFIX}.alive.*"


def prefill_subject(prefill_worker: str, decode_worker: str) -> str:
    """Where decode worker `decode_worker` sends prefill halves to `prefill_worker` (request/reply):
    a worker's NATS permissions let it name itself as the decode side only, and the prefill worker
    reports to the decode worker the subject names (`prefilled_subject`)."""
    return f"{PREFIX}.prefill.{token(prefill_worker)}.{token(decode_worker)}"


def prefill_subjects_to(prefill_worker: str) -> str:
    """Every decode worker's prefill halves for one prefill worker (its subscription)."""
    return f"{PREFIX}.prefill.{token(prefill_worker)}.*"


def prefill_subjects_from(decode_worker: str) -> str:
    """One decode worker's prefill halves to any prefill worker (its NATS permission)."""
    return f"{PREFIX}.prefill.*.{token(decode_worker)}"


def prefill_wildcard() -> str:
    return f"{PREFIX}.prefill.*.*"


def prefill_sender(subject: str) -> str:
    """The decode worker token of a prefill subject (its last token)."""
    return subject.rsplit(".", 1)[-1]


def prefilled_subject(decode_worker: str) -> str:
    """Where prefill workers tell decode worker `decode_worker` how its prefill halves ended."""
    return f"{PREFIX}.prefilled.{token(decode_worker)}"


def prefilled_subject_of_token(decode_token: str) -> str:
    """`prefilled_subject` of a worker named by its subject token (as `prefill_sender` gives it)."""
    return f"{PREFIX}.prefilled.{decode_token}"


def prefilled_wildcard() -> str:
    return f"{PREFIX}.prefilled.*"


def scale_subject(pool: str) -> str:
    return f"{PREFIX}.scale.{token(pool)}"


def scale_wildcard() -> str:
    return f"{PREFIX}.scale.*"


def claim_key(request_id: str, attempt: int) -> str:
    """Key of an attempt's claim in the `claims` bucket (base64url: any request id is one key)."""
    encoded = base64.urlsafe_b64encode(request_id.encode()).decode().rstrip("=")
    return f"{encoded}.{attempt}"


def dispatch_key(request_id: str) -> str:
    """Key of a request's dispatch record in the `dispatches` bucket (base64url, as `claim_key`)."""
    return base64.urlsafe_b64encode(request_id.encode()).decode().rstrip("=")


def dispatch_put_subject(request_id: str) -> str:
    """Where a dispatch record is put (the bucket's KV subject for the request's key)."""
    return f"$KV.{DISPATCHES_BUCKET}.{dispatch_key(request_id)}"


def claim_holder_worker(holder: str) -> str:
    """The worker id of a claim's holder (`<worker_id>@<started>`, services/worker/claims.py)."""
    return holder.rpartition("@")[0] or holder


def worker_key(worker_id: str) -> str:
    """Key of a worker's heartbeat in the `workers` KV bucket."""
    return _durable(worker_id)


RESULT_FROM_WORKER = "w"  # a worker's result of a line it ran: judged by the batch service
RESULT_FROM_OWNER = "o"  # the batch service's own record of a line's result: what readers count


def batch_result_subject(batch_id: str, kind: str, sender: str) -> str:
    """`inferbus.batchres.<batch>.<w | o>.<sender>`: a result of one of `batch_id`'s lines, published
    by `sender` (a worker, or the batch service `batch-<id>`); NATS permissions bind the last token
    to the publisher."""
    return f"{PREFIX}.batchres.{token(batch_id)}.{kind}.{token(sender)}"


def batch_results_filter(batch_id: str) -> str:
    """Every result of `batch_id`'s lines, whoever published it."""
    return f"{PREFIX}.batchres.{token(batch_id)}.>"


def batch_results_kept_filter(batch_id: str) -> str:
    """The results of `batch_id`'s lines the batch service recorded as theirs (what readers count)."""
    return f"{PREFIX}.batchres.{token(batch_id)}.{RESULT_FROM_OWNER}.*"


def batch_result_publish_wildcard(kind: str, sender: str | None = None) -> str:
    """Results of any batch's lines, published as `sender` (any sender of that kind with None)."""
    return f"{PREFIX}.batchres.*.{kind}.{'*' if sender is None else token(sender)}"


def batch_result_sender(subject: str) -> tuple[str, str] | None:
    """(kind, sender token) of a result subject; None for one that names no sender."""
    parts = subject.split(".")
    if len(parts) != 5:
        return None
    return parts[3], parts[4]


def batch_results_stream_subjects() -> list[str]:
    return [f"{PREFIX}.batchres.>"]


def batch_key(tenant: str, batch_id: str) -> str:
    """Key of a batch in the `batches` bucket: the tenant first, so a tenant's batches are one
    key filter (`<tenant>.>`) and no tenant can name another's."""
    return f"{_durable(tenant)}.{_durable(batch_id)}"


def file_key(tenant: str, file_id: str) -> str:
    return f"{_durable(tenant)}.{_durable(file_id)}"


# ---- internal producers: the OpenAI API over NATS request/reply ----------------------------------
#   inferbus.api.v1.chat.completions | inferbus.api.v1.completions   request/reply (queue group below)
#   inferbus.api.cancel.<gateway>.<call>                              a producer abandoning a stream

API_QUEUE = "gateway"  # every gateway replica subscribes in this queue group: one answers each request
_API_PATHS = {"chat": "chat.completions", "completion": "completions"}


def api_subject(endpoint: Literal["chat", "completion"]) -> str:
    """Where an internal producer sends `/v1/chat/completions` or `/v1/completions` bodies."""
    return f"{PREFIX}.api.v1.{_API_PATHS[endpoint]}"


def api_endpoint(subject: str) -> Literal["chat", "completion"] | None:
    for endpoint, path in _API_PATHS.items():
        if subject == f"{PREFIX}.api.v1.{path}":
            return endpoint  # type: ignore[return-value]
    return None


def api_wildcard() -> str:
    return f"{PREFIX}.api.v1.>"


def api_cancel_subject(gateway_id: str, call_id: str) -> str:
    return f"{PREFIX}.api.cancel.{token(gateway_id)}.{token(call_id)}"


def api_cancel_all() -> str:
    """Every gateway's internal-producer cancel subjects (for permissions)."""
    return f"{PREFIX}.api.cancel.*.*"


def api_cancel_wildcard(gateway_id: str) -> str:
    return f"{PREFIX}.api.cancel.{token(gateway_id)}.*"


def response_key(tenant: str, response_id: str) -> str:
    """Key of a stored response in the `responses` bucket; tenant first, like `batch_key`."""
    return f"{_durable(tenant)}.{_durable(response_id)}"



# ---- releases (`models` bucket) ---------------------------------------------------------------


def release_key(release_id: str) -> str:
    """Key of an immutable `Release` in the `models` bucket (`release.<64 hex>`)."""
    return f"release.{release_id.removeprefix('sha256:')}"


def rollout_key(model: str) -> str:
    """Key of a model's `Rollout` in the `models` bucket (base64url: any model id is one key)."""
    import base64

    return "rollout." + base64.urlsafe_b64encode(model.encode()).decode().rstrip("=")


def adapter_rollout_key(model: str, adapter: str) -> str:
    """Key of the `Rollout` of LoRA adapter `adapter` of `model` (its canary between two versions)."""
    import base64

    return rollout_key(model) + "." + base64.urlsafe_b64encode(adapter.encode()).decode().rstrip("=")


def release_subject(model: str) -> str:
    return f"{PREFIX}.release.{token(model)}"


def release_wildcard() -> str:
    return f"{PREFIX}.release.*"
