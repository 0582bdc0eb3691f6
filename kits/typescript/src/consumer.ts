// An example shelfsync consumer: what the Rust kit (shared/feed) and the Python kit
// (kits/python) do, in one file, for a team that follows the change stream from Node.
//
//  1. bootstrap: for every place in the filter, the latest complete keyframe (read
//     with direct gets on <PREFIX>_KEYFRAMES) is handed to `apply` as snapshots; if
//     there is none, a KeyframeRequest on <prefix>.ctl.keyframe asks storage for one;
//  2. tail: a durable pull consumer on <prefix>.changes.<brand|*>.<place|*>, from
//     just after the oldest of those keyframes' `changes_seq`, acked after `apply`;
//  3. newer-only: a record version is applied only if its `updated_at` is newer than
//     the one applied before (JetStream delivers at least once);
//  4. at each keyframe marker, the place's digest is compared with the marker's; a
//     drifted place is reset, reloaded from the marker's keyframe, and its changes
//     between the keyframe's `changes_seq` and the marker applied again.
import { connect, createInbox, type NatsConnection } from "@nats-io/transport-node";
import {
  AckPolicy,
  DeliverPolicy,
  jetstream,
  jetstreamManager,
  type ConsumerMessages,
  type JetStreamManager,
  type JsMsg,
} from "@nats-io/jetstream";

import { Digest } from "./digest.js";
import {
  big,
  CHANGE_KIND,
  Contract,
  type Change,
  type ChangeBatch,
  type KeyframeBatch,
  type KeyframeMark,
  type KeyframeReply,
  type Origin,
  type Product,
  type Record,
  type RecordState,
} from "./proto.js";

export { connect };

export type UpdateKind = "created" | "updated" | "deleted" | "snapshot";

/** One record's new version, as the consumer hands it to a handler. */
export interface Update {
  brandId: bigint;
  placeId: bigint;
  productId: string;
  updatedAt: bigint;
  kind: UpdateKind;
  after: Record;
  /** The new version's Product and RecordState, decoded from `after.data` / `after.state`. */
  product: Product;
  state: RecordState;
  /** The previous version; null for a creation or a snapshot. */
  before: Record | null;
  /** `before` came without data or state (the change was too large): read the record if needed. */
  beforeOmitted: boolean;
  origin: Origin | null;
}

export interface Handler {
  apply(updates: Update[]): Promise<void>;
  resetPlace(brandId: bigint, placeId: bigint): Promise<void>;
}

export interface ConsumerOptions {
  /** Durable consumer name: one per instance (the state is in memory). */
  name: string;
  /** The deployment's `nats.prefix`. */
  prefix?: string;
  brand?: bigint;
  place?: bigint;
  requestKeyframeIfMissing?: boolean;
  /** How many storage replicas answer a keyframe request (`storage.replicas`). */
  keyframeResponders?: number;
  contract?: Contract;
}

export interface Status {
  bootstrapped: boolean;
  delivered: number;
  duplicates: number;
  keyframeChecks: number;
  driftRepairs: number;
  poison: number;
  /** CHANGES stream sequence of the last message handled. */
  position: number;
}

interface Known { updatedAt: bigint; deleted: boolean }
interface PlaceState { records: Map<string, Known>; digest: Digest }

const placeKey = (b: bigint, p: bigint) => `${b}.${p}`;
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

function streamPrefix(prefix: string): string {
  return prefix.replace(/[^A-Za-z0-9]/g, "_").toUpperCase();
}

export class ExampleConsumer {
  readonly status: Status = {
    bootstrapped: false, delivered: 0, duplicates: 0, keyframeChecks: 0, driftRepairs: 0, poison: 0,
    position: 0,
  };
  private readonly places = new Map<string, PlaceState>();
  private readonly prefix: string;
  private readonly contract: Contract;
  private jsm!: JetStreamManager;
  private messages: ConsumerMessages | null = null;
  private loop: Promise<void> | null = null;

  constructor(private readonly nc: NatsConnection, private readonly opts: ConsumerOptions,
    private readonly handler: Handler) {
    this.prefix = opts.prefix ?? "shelfsync";
    this.contract = opts.contract ?? new Contract();
  }

  private get changesStream() { return `${streamPrefix(this.prefix)}_CHANGES`; }
  private get keyframesStream() { return `${streamPrefix(this.prefix)}_KEYFRAMES`; }
  private filter(kind: string) {
    const b = this.opts.brand === undefined ? "*" : String(this.opts.brand);
    const p = this.opts.place === undefined ? "*" : String(this.opts.place);
    return `${this.prefix}.${kind}.${b}.${p}`;
  }

  /** Bootstraps, creates the consumer and starts tailing in the background. */
  async start(): Promise<void> {
    this.jsm = await jetstreamManager(this.nc);
    const start = await this.bootstrap();
    // The state is rebuilt from keyframes at every start: the old position means nothing.
    await this.jsm.consumers.delete(this.changesStream, this.opts.name).catch(() => undefined);
    await this.jsm.consumers.add(this.changesStream, {
      durable_name: this.opts.name,
      filter_subject: this.filter("changes"),
      ack_policy: AckPolicy.Explicit,
      ack_wait: 30_000_000_000,
      max_ack_pending: 1000,
      inactive_threshold: 3_600_000_000_000,
      ...(start === 0n
        ? { deliver_policy: DeliverPolicy.All }
        : { deliver_policy: DeliverPolicy.StartSequence, opt_start_seq: Number(start + 1n) }),
    });
    const consumer = await jetstream(this.nc).consumers.get(this.changesStream, this.opts.name);
    this.messages = await consumer.consume({ max_messages: 100 });
    this.status.bootstrapped = true;
    const messages = this.messages;
    this.loop = (async () => {
      for await (const m of messages) await this.handle(m);
    })();
  }

  /** Stops after the message in hand. */
  async stop(): Promise<void> {
    await this.messages?.close();
    await this.loop;
  }

  digest(brandId: bigint, placeId: bigint): Digest {
    return this.places.get(placeKey(brandId, placeId))?.digest ?? new Digest();
  }

  // --- bootstrap and keyframes ----------------------------------------------

  private async bootstrap(): Promise<bigint> {
    let places = await this.keyframePlaces();
    if (places.length === 0 && (this.opts.requestKeyframeIfMissing ?? true)) {
      await this.requestKeyframe();
      places = await this.keyframePlaces();
    }
    let start: bigint | null = null;
    for (const [b, p] of places) {
      const latest = await this.latest(b, p);
      if (!latest) continue;
      await this.loadKeyframe(latest);
      const seq = big(latest.last.changes_seq);
      start = start === null || seq < start ? seq : start;
    }
    return start ?? 0n;
  }

  private async keyframePlaces(): Promise<Array<[bigint, bigint]>> {
    const info = await this.jsm.streams.info(this.keyframesStream, { subjects_filter: this.filter("keyframes") });
    return Object.keys(info.state.subjects ?? {}).map((s) => {
      const t = s.split(".");
      return [BigInt(t[t.length - 2]), BigInt(t[t.length - 1])] as [bigint, bigint];
    });
  }

  private async requestKeyframe(): Promise<KeyframeReply[]> {
    const one = this.opts.brand !== undefined && this.opts.place !== undefined;
    const want = one ? 1 : Math.max(this.opts.keyframeResponders ?? 1, 1);
    const inbox = createInbox();
    const sub = this.nc.subscribe(inbox, { max: want, timeout: 600_000 });
    const request = this.contract.encode("KeyframeRequest", {
      keyframe_id: `kf-${BigInt(Date.now()) * 1000n}`,
      brand_id: one ? String(this.opts.brand) : "0",
      place_id: one ? String(this.opts.place) : "0",
    });
    this.nc.publish(`${this.prefix}.ctl.keyframe`, request, { reply: inbox });
    const replies: KeyframeReply[] = [];
    try {
      for await (const m of sub) replies.push(this.contract.decode<KeyframeReply>("KeyframeReply", m.data));
    } catch {
      // timed out: go on with what answered
    }
    return replies;
  }

  private async lastPart(b: bigint, p: bigint): Promise<{ last: KeyframeBatch; seq: number } | null> {
    const m = await this.jsm.direct.getMessage(this.keyframesStream, { last_by_subj: `${this.prefix}.keyframes.${b}.${p}` });
    return m ? { last: this.contract.decode<KeyframeBatch>("KeyframeBatch", m.data), seq: m.seq } : null;
  }

  /** The latest complete keyframe of a place (waits for one being written). */
  private async latest(b: bigint, p: bigint): Promise<{ last: KeyframeBatch; seq: number } | null> {
    for (let i = 0; i < 600; i++) {
      const got = await this.lastPart(b, p);
      if (!got || got.last.last) return got;
      await sleep(100);
    }
    throw new Error(`keyframe of ${b}.${p} did not complete in time`);
  }

  /** The keyframe a marker names (same id and as_of), once complete; null if a newer one replaced it. */
  private async ofMark(b: bigint, p: bigint, mark: KeyframeMark) {
    for (let i = 0; i < 600; i++) {
      const got = await this.lastPart(b, p);
      if (got) {
        if (got.last.keyframe_id === mark.keyframe_id && big(got.last.as_of) === big(mark.as_of)) {
          if (got.last.last) return got;
        } else if (big(got.last.as_of) > big(mark.as_of)) {
          return null;
        }
      }
      await sleep(100);
    }
    return null;
  }

  /** Replaces a place with a keyframe of it, part by part. */
  private async loadKeyframe(kf: { last: KeyframeBatch; seq: number }): Promise<void> {
    const b = big(kf.last.brand_id);
    const p = big(kf.last.place_id);
    await this.handler.resetPlace(b, p);
    this.places.delete(placeKey(b, p));
    const subject = `${this.prefix}.keyframes.${b}.${p}`;
    let seq = kf.last.part === 0 ? kf.seq : Number(big(kf.last.first_seq));
    for (;;) {
      const m = await this.jsm.direct.getMessage(this.keyframesStream, { seq, next_by_subj: subject });
      if (!m) throw new Error(`${subject}: part missing after #${seq}`);
      seq = m.seq + 1;
      const part = this.contract.decode<KeyframeBatch>("KeyframeBatch", m.data);
      if (part.keyframe_id !== kf.last.keyframe_id) continue; // an aborted run in between
      const updates = part.records.filter((r) => r.key).map((r) => this.update(r, null, "snapshot", false, null));
      await this.handler.apply(updates);
      for (const u of updates) this.remember(u);
      this.status.delivered += updates.length;
      if (part.last) return;
    }
  }

  // --- the change stream -----------------------------------------------------

  private async handle(m: JsMsg): Promise<void> {
    this.status.position = Math.max(this.status.position, m.seq);
    try {
      let batch: ChangeBatch;
      try {
        batch = this.contract.decode<ChangeBatch>("ChangeBatch", m.data);
      } catch (e) {
        this.status.poison += 1;
        m.term();
        return;
      }
      if (batch.keyframe) {
        await this.checkMarker(m.subject, m.seq, batch.keyframe);
      } else {
        await this.applyChanges(batch.changes);
      }
      m.ack();
    } catch (e) {
      console.warn(`shelfsync consumer ${this.opts.name}: ${String(e)}; retrying in 1 s`);
      m.nak(1000);
    }
  }

  private async checkMarker(subject: string, markerSeq: number, mark: KeyframeMark): Promise<void> {
    const t = subject.split(".");
    const b = BigInt(t[t.length - 2]);
    const p = BigInt(t[t.length - 1]);
    this.status.keyframeChecks += 1;
    const place = this.places.get(placeKey(b, p));
    if (place) {
      // Tombstones deleted before the cutoff are purged by storage: not in its digest.
      for (const [id, k] of place.records) {
        if (k.deleted && k.updatedAt < big(mark.tombstone_cutoff)) {
          place.digest.remove(id, k.updatedAt);
          place.records.delete(id);
        }
      }
    }
    const ours = this.digest(b, p);
    if (ours.sum === big(mark.digest) && BigInt(ours.count) === big(mark.total)) return;
    console.warn(`shelfsync consumer ${this.opts.name}: place ${b}.${p} drifted from keyframe ${mark.keyframe_id}; repairing`);
    const kf = await this.ofMark(b, p, mark);
    if (!kf) return; // a newer keyframe replaced it: the next marker repairs the place
    await this.loadKeyframe(kf);
    // What changed between the freeze and the marker is applied again, newer-only.
    await this.replay(b, p, big(kf.last.changes_seq) + 1n, markerSeq);
    this.status.driftRepairs += 1;
  }

  /** Applies the place's changes stored in [from, until), with STREAM.MSG.GET next_by_subj. */
  private async replay(b: bigint, p: bigint, from: bigint, until: number): Promise<void> {
    const subject = `${this.prefix}.changes.${b}.${p}`;
    let seq = Number(from < 1n ? 1n : from);
    while (seq < until) {
      const r = await this.nc.request(`$JS.API.STREAM.MSG.GET.${this.changesStream}`,
        JSON.stringify({ seq, next_by_subj: subject }), { timeout: 10_000 });
      const reply = JSON.parse(new TextDecoder().decode(r.data));
      if (reply.error) {
        if (reply.error.code === 404) return;
        throw new Error(`replaying ${subject}: ${reply.error.description}`);
      }
      const found = Number(reply.message.seq);
      if (found >= until) return;
      seq = found + 1;
      const batch = this.contract.decode<ChangeBatch>("ChangeBatch", Buffer.from(reply.message.data ?? "", "base64"));
      if (!batch.keyframe) await this.applyChanges(batch.changes);
    }
  }

  private async applyChanges(changes: Change[]): Promise<void> {
    const updates: Update[] = [];
    const seenHere = new Map<string, bigint>();
    for (const c of changes) {
      const after = c.after;
      const key = c.key ?? after?.key;
      if (!after || !key) continue;
      const kind: UpdateKind = c.kind === CHANGE_KIND.CREATED ? "created" : c.kind === CHANGE_KIND.DELETED ? "deleted" : "updated";
      const u = this.update(after, c.before ?? null, kind, c.before_omitted, c.origin ?? null, c.key ?? undefined);
      const k = `${u.brandId}.${u.placeId}.${u.productId}`;
      const prev = seenHere.get(k);
      const newer = prev === undefined ? this.isNewer(u) : u.updatedAt > prev;
      if (newer) {
        seenHere.set(k, u.updatedAt);
        updates.push(u);
      } else {
        this.status.duplicates += 1;
      }
    }
    if (updates.length === 0) return;
    await this.handler.apply(updates);
    for (const u of updates) this.remember(u);
    this.status.delivered += updates.length;
  }

  private update(after: Record, before: Record | null, kind: UpdateKind, beforeOmitted: boolean,
    origin: Origin | null, key = after.key ?? undefined): Update {
    return {
      brandId: big(key?.brand_id), placeId: big(key?.place_id), productId: key?.product_id ?? "",
      updatedAt: big(after.updated_at), kind, after,
      product: this.contract.product(after), state: this.contract.state(after),
      before, beforeOmitted, origin,
    };
  }

  private isNewer(u: Update): boolean {
    const known = this.places.get(placeKey(u.brandId, u.placeId))?.records.get(u.productId);
    return known === undefined || u.updatedAt > known.updatedAt;
  }

  private remember(u: Update): void {
    const k = placeKey(u.brandId, u.placeId);
    let place = this.places.get(k);
    if (!place) {
      place = { records: new Map(), digest: new Digest() };
      this.places.set(k, place);
    }
    const known = place.records.get(u.productId);
    if (known) place.digest.replace(u.productId, known.updatedAt, u.updatedAt);
    else place.digest.add(u.productId, u.updatedAt);
    place.records.set(u.productId, { updatedAt: u.updatedAt, deleted: u.after.deleted });
  }
}
