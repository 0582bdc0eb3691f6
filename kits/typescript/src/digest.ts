// The partition of a place and the digest of a place, as storage computes them
// (docs/DESIGN.md; checked against proto/golden/vectors.json). 64-bit values are
// bigints: a JavaScript number stops being exact at 2^53.
import { xxh3 } from "@node-rs/xxhash";

const MASK = (1n << 64n) - 1n;

/** xxh3-64 (seed 0) of `brand_id` then `place_id` (8 little-endian bytes each) mod `partitions`. */
export function partitionOf(brandId: bigint, placeId: bigint, partitions: number): number {
  const buf = Buffer.alloc(16);
  buf.writeBigInt64LE(brandId, 0);
  buf.writeBigInt64LE(placeId, 8);
  return Number(xxh3.xxh64(buf, 0n) % BigInt(Math.max(partitions, 1)));
}

/** One record's term: xxh3-64 (seed 0) of the product id's UTF-8 bytes then `updated_at` (8 LE bytes). */
export function term(productId: string, updatedAt: bigint): bigint {
  const id = Buffer.from(productId, "utf8");
  const buf = Buffer.alloc(id.length + 8);
  id.copy(buf, 0);
  buf.writeBigInt64LE(updatedAt, id.length);
  return xxh3.xxh64(buf, 0n);
}

/** The wrapping (mod 2^64) sum of the terms of a place's records, with their count. */
export class Digest {
  sum = 0n;
  count = 0;

  add(productId: string, updatedAt: bigint): void {
    this.sum = (this.sum + term(productId, updatedAt)) & MASK;
    this.count += 1;
  }

  remove(productId: string, updatedAt: bigint): void {
    this.sum = (this.sum - term(productId, updatedAt)) & MASK;
    this.count = Math.max(this.count - 1, 0);
  }

  /** A record moved from `old` to `updatedAt`. */
  replace(productId: string, old: bigint, updatedAt: bigint): void {
    this.sum = (this.sum - term(productId, old) + term(productId, updatedAt)) & MASK;
  }
}
