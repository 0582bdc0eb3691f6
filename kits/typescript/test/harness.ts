// What the consumer's tests run against: a private nats-server (JetStream) and
// redis-server on free loopback ports for the test file, and per test its own
// prefix and namespace with the real storage binary and the shelfsync CLI
// (SHELFSYNC__... variables, as the Rust and Python tests do). Never 4222 / 6379.
//
// SHELFSYNC_NATS_SERVER (else what scripts/install-deps.sh prints),
// SHELFSYNC_REDIS_SERVER (else redis-server on PATH), SHELFSYNC_BIN_DIR (else
// $CARGO_TARGET_DIR/debug, else target/debug) for shelfsync and shelfsync-storage.
import { spawn, execFileSync, type ChildProcess } from "node:child_process";
import { mkdtempSync, rmSync, existsSync } from "node:fs";
import { createServer, connect as tcpConnect } from "node:net";
import { tmpdir } from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { randomBytes, randomUUID } from "node:crypto";

import { connect, type NatsConnection } from "@nats-io/transport-node";
import { jetstream, jetstreamManager, type JetStreamManager } from "@nats-io/jetstream";

import { Contract, partitionOf } from "../src/index.js";

export const REPO = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../../../..");
export const PARTITIONS = 4;
const contract = new Contract();

function binDir(): string {
  if (process.env.SHELFSYNC_BIN_DIR) return process.env.SHELFSYNC_BIN_DIR;
  const target = process.env.CARGO_TARGET_DIR ? path.resolve(REPO, process.env.CARGO_TARGET_DIR) : path.join(REPO, "target");
  return path.join(target, "debug");
}

export function workspaceBin(name: string): string {
  const p = path.join(binDir(), name);
  if (!existsSync(p)) throw new Error(`${p} not found: run cargo build --workspace --bins first`);
  return p;
}

function natsServerBin(): string {
  if (process.env.SHELFSYNC_NATS_SERVER) return process.env.SHELFSYNC_NATS_SERVER;
  const out = execFileSync(path.join(REPO, "scripts/install-deps.sh"), { encoding: "utf8", stdio: ["ignore", "pipe", "inherit"] });
  return out.trim().split("\n").pop()!;
}

async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const s = createServer();
    s.once("error", reject);
    s.listen(0, "127.0.0.1", () => {
      const port = (s.address() as { port: number }).port;
      s.close(() => resolve(port));
    });
  });
}

export const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** Until `proc` exits, or `ms` passed (the timer is cleared: it must not keep Node alive). */
function exited(proc: ChildProcess, ms: number): Promise<void> {
  if (proc.exitCode !== null || proc.signalCode !== null) return Promise.resolve();
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    proc.once("exit", () => {
      clearTimeout(timer);
      resolve();
    });
  });
}

/** Polls `cond` every 20 ms until it holds; fails with `what` after `timeoutMs`. */
export async function eventually(what: string, cond: () => boolean | Promise<boolean>, timeoutMs = 30_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    if (await cond()) return;
    if (Date.now() > deadline) throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
    await sleep(20);
  }
}

function probe(port: number, send: string | null, expect: (s: string) => boolean): Promise<boolean> {
  return new Promise((resolve) => {
    const sock = tcpConnect(port, "127.0.0.1");
    let buf = "";
    sock.setTimeout(1000, () => { sock.destroy(); resolve(false); });
    sock.on("error", () => resolve(false));
    sock.on("connect", () => { if (send) sock.write(send); });
    sock.on("data", (d) => { buf += d.toString(); if (expect(buf)) { sock.destroy(); resolve(true); } });
    sock.on("close", () => resolve(expect(buf)));
  });
}

async function httpOk(url: string): Promise<boolean> {
  try { return (await fetch(url)).status === 200; } catch { return false; }
}

export class Server {
  constructor(readonly proc: ChildProcess, readonly dir: string, readonly url: string) {}
  async stop(): Promise<void> {
    if (this.proc.exitCode === null) {
      const done = exited(this.proc, 10_000);
      this.proc.kill("SIGTERM");
      await done;
      if (this.proc.exitCode === null && this.proc.signalCode === null) this.proc.kill("SIGKILL");
    }
    rmSync(this.dir, { recursive: true, force: true });
  }
}

export async function startNats(): Promise<Server> {
  const dir = mkdtempSync(path.join(tmpdir(), "kit-ts-nats-"));
  const [port, monitor] = [await freePort(), await freePort()];
  const proc = spawn(natsServerBin(), ["-a", "127.0.0.1", "-p", String(port), "-m", String(monitor), "-js",
    "-sd", path.join(dir, "js"), "-l", path.join(dir, "nats.log")], { stdio: "ignore" });
  const server = new Server(proc, dir, `nats://127.0.0.1:${port}`);
  await eventually("nats-server", async () => {
    if (proc.exitCode !== null) throw new Error(`nats-server exited ${proc.exitCode}`);
    return (await probe(port, null, (s) => s.includes('"jetstream":true'))) && httpOk(`http://127.0.0.1:${monitor}/healthz`);
  }, 20_000);
  return server;
}

export async function startRedis(): Promise<Server> {
  const dir = mkdtempSync(path.join(tmpdir(), "kit-ts-redis-"));
  const port = await freePort();
  const bin = process.env.SHELFSYNC_REDIS_SERVER ?? "redis-server";
  const proc = spawn(bin, ["--port", String(port), "--bind", "127.0.0.1", "--dir", dir, "--save", "",
    "--appendonly", "no", "--daemonize", "no", "--logfile", path.join(dir, "redis.log")], { stdio: "ignore" });
  const server = new Server(proc, dir, `redis://127.0.0.1:${port}`);
  await eventually("redis-server", async () => {
    if (proc.exitCode !== null) throw new Error(`redis-server exited ${proc.exitCode}`);
    return probe(port, "PING\r\n", (s) => s.startsWith("+PONG"));
  }, 20_000);
  return server;
}

/** One test's deployment: its own prefix and namespace, streams set up, storage running. */
export class Stack {
  readonly prefix = "t" + randomBytes(8).toString("hex").slice(0, 10);
  readonly env: NodeJS.ProcessEnv;
  private storage: ChildProcess | null = null;
  nc!: NatsConnection;
  jsm!: JetStreamManager;
  private readonly http: string;

  private constructor(natsUrl: string, redisUrl: string, httpPort: number) {
    this.http = `127.0.0.1:${httpPort}`;
    this.env = {
      SHELFSYNC__NATS__URL: natsUrl,
      SHELFSYNC__NATS__PREFIX: this.prefix,
      SHELFSYNC__REDIS__URL: redisUrl,
      SHELFSYNC__REDIS__NAMESPACE: this.prefix,
      SHELFSYNC__STORAGE__PARTITIONS: String(PARTITIONS),
      SHELFSYNC__STORAGE__ACK_WAIT: "5000ms",
      SHELFSYNC__STORAGE__RETRY_DELAY: "100ms",
      SHELFSYNC__STORAGE__KEYFRAME_SCHEDULE: "",
      SHELFSYNC__STORAGE__HTTP_LISTEN: this.http,
      SHELFSYNC__INGEST__LISTEN: "127.0.0.1:0",
      RUST_LOG: "warn",
    };
  }

  static async start(nats: Server, redis: Server): Promise<Stack> {
    const s = new Stack(nats.url, redis.url, await freePort());
    s.cli("setup");
    s.storage = spawn(workspaceBin("shelfsync-storage"), [], { env: s.env, stdio: ["ignore", "ignore", "inherit"] });
    await eventually("storage to be ready", async () => {
      if (s.storage!.exitCode !== null) throw new Error(`storage exited ${s.storage!.exitCode}`);
      return httpOk(`http://${s.http}/readyz`);
    });
    s.nc = await connect({ servers: nats.url, name: "kit-ts-test" });
    s.jsm = await jetstreamManager(s.nc);
    return s;
  }

  /** The shelfsync CLI with this test's settings only; its stdout. */
  cli(...args: string[]): string {
    return execFileSync(workspaceBin("shelfsync"), args, { env: this.env, encoding: "utf8", timeout: 60_000, stdio: ["ignore", "pipe", "pipe"] });
  }

  async stop(): Promise<void> {
    await this.nc?.close();
    if (this.storage && this.storage.exitCode === null) {
      const done = exited(this.storage, 15_000);
      this.storage.kill("SIGTERM");
      await done;
      if (this.storage.exitCode === null && this.storage.signalCode === null) this.storage.kill("SIGKILL");
    }
  }

  /** PATCHes as one CommandBatch per partition on <prefix>.cmd.<partition>. */
  async write(brand: number, places: number[], items: number, priceBase: number, idPrefix = "sku"): Promise<void> {
    const byPartition = new Map<number, object[]>();
    for (const p of places) {
      for (let i = 0; i < items; i++) {
        const data = contract.encode("Product", { title: "t", price: priceBase + i, stock: 1, currency: "EUR" });
        const part = partitionOf(BigInt(brand), BigInt(p), PARTITIONS);
        if (!byPartition.has(part)) byPartition.set(part, []);
        byPartition.get(part)!.push({ key: { brand_id: brand, place_id: p, product_id: `${idPrefix}-${i}` }, kind: "COMMAND_KIND_PATCH", data });
      }
    }
    const js = jetstream(this.nc);
    for (const [partition, commands] of byPartition) {
      for (let i = 0; i < commands.length; i += 1000) {
        const batch = contract.encode("CommandBatch", { partition, commands: commands.slice(i, i + 1000), origin: { source: "kit-ts-test" } });
        const { headers } = await import("@nats-io/transport-node");
        const h = headers();
        h.set("Nats-Msg-Id", `kit-ts-test:${randomUUID()}`);
        h.set("Shelfsync-Type", "shelfsync.v1.CommandBatch");
        await js.publish(`${this.prefix}.cmd.${partition}`, batch, { headers: h });
      }
    }
  }

  private streamPrefix(): string { return this.prefix.toUpperCase(); }

  /** Until storage applied every command (CMD is a work queue). */
  async waitApplied(): Promise<void> {
    await eventually("storage to apply every command", async () =>
      (await this.jsm.streams.info(`${this.streamPrefix()}_CMD`)).state.messages === 0);
  }

  async changesLastSeq(): Promise<number> {
    return (await this.jsm.streams.info(`${this.streamPrefix()}_CHANGES`)).state.last_seq;
  }

  async deleteChange(seq: number): Promise<void> {
    await this.jsm.streams.deleteMessage(`${this.streamPrefix()}_CHANGES`, seq);
  }

  /** Every record storage holds for a place (read API, cursor pages): product id -> updated_at. */
  async records(brand: number, place: number): Promise<Map<string, bigint>> {
    const out = new Map<string, bigint>();
    let cursor = "";
    for (;;) {
      const req = contract.encode("ReadRequest", { brand_id: brand, place_id: place, cursor, limit: 1000 });
      const r = await this.nc.request(`${this.prefix}.read.place`, req, { timeout: 10_000 });
      const reply = contract.decode<any>("ReadReply", r.data);
      if (reply.error) throw new Error(reply.error);
      for (const rec of reply.records) out.set(rec.key.product_id, BigInt(rec.updated_at.toString()));
      cursor = reply.next_cursor;
      if (!cursor) return out;
    }
  }
}
