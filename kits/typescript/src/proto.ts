// The wire contract, loaded at run time from proto/shelfsync/v1/shelfsync.proto
// with protobufjs (no generated code to keep current), and the few message shapes
// this consumer reads, typed by hand.
import { fileURLToPath } from "node:url";
import path from "node:path";
import protobuf from "protobufjs";

/** The repository's contract; `SHELFSYNC_PROTO` points elsewhere (a copy in your repository). */
export const DEFAULT_PROTO = path.resolve(
  path.dirname(fileURLToPath(import.meta.url)),
  "../../../../proto/shelfsync/v1/shelfsync.proto",
);

/** A 64-bit integer as protobufjs decodes it: a Long (the `long` package) or a number. */
export type Int64 = number | { toString(): string };

/** A 64-bit integer as a bigint (unsigned fields decode as unsigned Longs). */
export function big(v: Int64 | null | undefined): bigint {
  if (v === null || v === undefined) return 0n;
  return typeof v === "number" ? BigInt(v) : BigInt(v.toString());
}

export interface RecordKey { brand_id: Int64; place_id: Int64; product_id: string }
export interface Record {
  key?: RecordKey | null;
  data: Uint8Array; // a serialized Product
  state: Uint8Array; // a serialized RecordState
  generation: Int64;
  absent: boolean;
  deleted: boolean;
  created_at: Int64;
  updated_at: Int64;
}
export interface Product {
  title?: string; category?: string; price?: Int64; old_price?: Int64; currency?: string;
  stock?: Int64; images: string[]; description?: string;
}
export interface RecordState { hidden?: boolean; reasons: string[]; decided_by?: string; decided_at?: Int64 }
export interface Origin { source: string; import_id: string; published_at: Int64 }
export interface Change {
  key?: RecordKey | null;
  before?: Record | null;
  after?: Record | null;
  kind: number; // ChangeKind: 1 CREATED, 2 UPDATED, 3 DELETED
  changed_data_fields: number[];
  changed_state_fields: number[];
  origin?: Origin | null;
  before_omitted: boolean;
}
export interface KeyframeMark { keyframe_id: string; total: Int64; digest: Int64; as_of: Int64; tombstone_cutoff: Int64 }
export interface ChangeBatch {
  changes: Change[]; partition: number; command_seq: Int64; part: number; keyframe?: KeyframeMark | null;
}
export interface KeyframeBatch {
  keyframe_id: string; brand_id: Int64; place_id: Int64; part: number; records: Record[]; last: boolean;
  total: Int64; digest: Int64; as_of: Int64; command_seq: Int64; changes_seq: Int64; first_seq: Int64;
  tombstone_cutoff: Int64;
}
export interface KeyframeReply { keyframe_id: string; places: number; records: Int64; error: string; replica: number }

export const CHANGE_KIND = { CREATED: 1, UPDATED: 2, DELETED: 3 } as const;

export class Contract {
  readonly root: protobuf.Root;
  constructor(protoPath: string = process.env.SHELFSYNC_PROTO ?? DEFAULT_PROTO) {
    // keepCase: the fields keep their proto names (product_id, updated_at).
    this.root = new protobuf.Root().loadSync(protoPath, { keepCase: true });
  }
  type(name: string): protobuf.Type {
    return this.root.lookupType(`shelfsync.v1.${name}`);
  }
  decode<T>(name: string, bytes: Uint8Array): T {
    return this.type(name).decode(bytes) as unknown as T;
  }
  encode(name: string, value: object): Uint8Array {
    const t = this.type(name);
    return t.encode(t.fromObject(value)).finish();
  }
  /** `data` of a record: the Product it holds (bytes inside the message). */
  product(r: Record): Product {
    return this.decode<Product>("Product", r.data ?? new Uint8Array());
  }
  /** `state` of a record: the RecordState it holds. */
  state(r: Record): RecordState {
    return this.decode<RecordState>("RecordState", r.state ?? new Uint8Array());
  }
}
