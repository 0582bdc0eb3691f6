// A runnable consumer: prints every update and the consumer's counters.
//
//   NATS_URL=nats://127.0.0.1:4222 SHELFSYNC_PREFIX=shelfsync CONSUMER_NAME=my-service-1 \
//     node dist/src/example.js
import { hostname } from "node:os";

import { connect, ExampleConsumer, type Update } from "./index.js";

const nc = await connect({ servers: process.env.NATS_URL ?? "nats://127.0.0.1:4222" });
const consumer = new ExampleConsumer(
  nc,
  {
    // One durable consumer per instance: its state lives in this process.
    name: process.env.CONSUMER_NAME ?? `example-${hostname()}`,
    prefix: process.env.SHELFSYNC_PREFIX ?? "shelfsync",
  },
  {
    async apply(updates: Update[]) {
      for (const u of updates) {
        const price = u.product.price === undefined ? "-" : String(u.product.price);
        console.log(`${u.kind} ${u.brandId}/${u.placeId}/${u.productId} price=${price} at=${u.updatedAt}`);
      }
    },
    async resetPlace(brandId: bigint, placeId: bigint) {
      console.log(`reset ${brandId}/${placeId}: a keyframe of it follows`);
    },
  },
);
await consumer.start();
console.log("live:", consumer.status);
const timer = setInterval(() => console.log(consumer.status), 10_000);
for (const signal of ["SIGINT", "SIGTERM"] as const) {
  process.once(signal, async () => {
    clearInterval(timer);
    await consumer.stop();
    await nc.drain();
  });
}
