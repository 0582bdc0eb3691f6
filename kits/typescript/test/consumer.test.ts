// The example consumer against real servers and the real storage binary.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";

import { ExampleConsumer, type Handler, type Update } from "../src/index.js";
import { eventually, Server, Stack, startNats, startRedis } from "./harness.js";

const BRAND = 7;
let nats: Server;
let redis: Server;

before(async () => {
  nats = await startNats();
  redis = await startRedis();
});
after(async () => {
  await redis?.stop();
  await nats?.stop();
});

/** Mirrors storage's records; remembers every version it was handed. */
class Mirror implements Handler {
  records = new Map<string, bigint>();
  applied: string[] = [];
  kinds: Record<string, number> = {};
  async apply(updates: Update[]): Promise<void> {
    for (const u of updates) {
      this.records.set(`${u.brandId}.${u.placeId}.${u.productId}`, u.updatedAt);
      this.applied.push(`${u.brandId}.${u.placeId}.${u.productId}@${u.updatedAt}`);
      this.kinds[u.kind] = (this.kinds[u.kind] ?? 0) + 1;
    }
  }
  async resetPlace(brandId: bigint, placeId: bigint): Promise<void> {
    for (const k of [...this.records.keys()]) if (k.startsWith(`${brandId}.${placeId}.`)) this.records.delete(k);
  }
  of(brand: number, place: number): Map<string, bigint> {
    const out = new Map<string, bigint>();
    for (const [k, v] of this.records) {
      const [b, p, ...id] = k.split(".");
      if (b === String(brand) && p === String(place)) out.set(id.join("."), v);
    }
    return out;
  }
  async equalsStorage(stack: Stack, brand: number, places: number[]): Promise<boolean> {
    for (const p of places) {
      const stored = await stack.records(brand, p);
      const mine = this.of(brand, p);
      if (stored.size !== mine.size) return false;
      for (const [id, at] of stored) if (mine.get(id) !== at) return false;
    }
    return true;
  }
}

async function withStack(fn: (stack: Stack) => Promise<void>): Promise<void> {
  const stack = await Stack.start(nats, redis);
  try {
    await fn(stack);
  } finally {
    await stack.stop();
  }
}

test("bootstraps from a keyframe, tails live changes, and its digests match the next markers", () =>
  withStack(async (stack) => {
    await stack.write(BRAND, [1, 2], 200, 100);
    await stack.waitApplied();
    stack.cli("keyframe");
    const mirror = new Mirror();
    const consumer = new ExampleConsumer(stack.nc, { name: "ts-boot", prefix: stack.prefix }, mirror);
    await consumer.start();
    try {
      assert.equal(mirror.kinds.snapshot, 400);
      assert.ok(await mirror.equalsStorage(stack, BRAND, [1, 2]));

      await stack.write(BRAND, [1], 20, 5000); // 20 updates
      await stack.write(BRAND, [2], 5, 0, "new"); // 5 creations
      await stack.waitApplied();
      await eventually("the consumer to catch up", () => mirror.equalsStorage(stack, BRAND, [1, 2]));
      assert.equal(mirror.kinds.updated, 20);
      assert.equal(mirror.kinds.created, 5);

      stack.cli("keyframe");
      await eventually("four markers checked (two keyframes, two places)", () => consumer.status.keyframeChecks >= 4);
      assert.equal(consumer.status.driftRepairs, 0);
      assert.equal(new Set(mirror.applied).size, mirror.applied.length, "no version applied twice");
    } finally {
      await consumer.stop();
    }
  }));

test("asks storage for a keyframe when there is none", () =>
  withStack(async (stack) => {
    await stack.write(BRAND, [3], 30, 100);
    await stack.waitApplied();
    const mirror = new Mirror();
    const consumer = new ExampleConsumer(stack.nc, { name: "ts-ask", prefix: stack.prefix }, mirror);
    await consumer.start();
    try {
      assert.equal(mirror.kinds.snapshot, 30);
      assert.ok(await mirror.equalsStorage(stack, BRAND, [3]));
    } finally {
      await consumer.stop();
    }
  }));

test("a consumer that missed changes is repaired at the next keyframe marker", () =>
  withStack(async (stack) => {
    await stack.write(BRAND, [1, 2], 50, 100);
    await stack.waitApplied();
    stack.cli("keyframe");
    // Changes no consumer will see: written after the keyframe, then deleted from the stream.
    const before = await stack.changesLastSeq();
    await stack.write(BRAND, [1], 10, 9000);
    await stack.waitApplied();
    const last = await stack.changesLastSeq();
    assert.ok(last > before, "the write caused changes");
    for (let seq = before + 1; seq <= last; seq++) await stack.deleteChange(seq);

    const mirror = new Mirror();
    const consumer = new ExampleConsumer(stack.nc, { name: "ts-drift", prefix: stack.prefix }, mirror);
    await consumer.start(); // from the keyframe, then the stream: the lost changes never come
    try {
      assert.equal(await mirror.equalsStorage(stack, BRAND, [1]), false, "place 1 is stale");
      assert.ok(await mirror.equalsStorage(stack, BRAND, [2]));
      stack.cli("keyframe");
      await eventually("the drift repaired", async () =>
        consumer.status.driftRepairs === 1 && (await mirror.equalsStorage(stack, BRAND, [1, 2])));
      await eventually("four markers checked (two keyframes, two places)", () => consumer.status.keyframeChecks >= 4);
      assert.equal(consumer.status.driftRepairs, 1, "place 2 did not drift");
    } finally {
      await consumer.stop();
    }
  }));
