export { Digest, partitionOf, term } from "./digest.js";
export { big, CHANGE_KIND, Contract, DEFAULT_PROTO } from "./proto.js";
export type { Change, ChangeBatch, KeyframeBatch, KeyframeMark, Product, Record, RecordState } from "./proto.js";
export { connect, ExampleConsumer } from "./consumer.js";
export type { ConsumerOptions, Handler, Status, Update, UpdateKind } from "./consumer.js";
