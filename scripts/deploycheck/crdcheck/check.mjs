//! Validates Prometheus Operator objects (monitoring.coreos.com) and KEDA objects (keda.sh)
//! against their CRD schemas, strictly.
//!
//! Why it exists: kubernetes-validate knows only Kubernetes' built-in kinds, and no registry this
//! project reaches ships the operator's CRD YAML. The npm package
//! @kubernetes-models/prometheus-operator 5.0.1 was generated from the CRDs of operator release
//! v0.90.1 (their openAPIV3Schema, compiled into ajv validators, and TypeScript declarations of
//! the same schema); @kubernetes-models/keda 2.0.0 likewise from KEDA's API types
//! (github.com/kedacore/keda/v2/apis/keda/v1alpha1: ScaledObject, TriggerAuthentication, ...).
//! Two passes per object:
//!
//!   schema  the compiled CRD schema: types, enums, patterns, required fields, formats;
//!   strict  every field the object sets must be declared by the CRD schema, as
//!           `kubectl apply --validate=strict` demands (the API server would silently prune it):
//!           the TypeScript compiler reads the generated declarations and the object is walked
//!           against the declared type, so every unknown field is reported, not only the first.
//!
//! Usage: node check.mjs DEPS_DIR < objects.json   (DEPS_DIR holds node_modules, installed from
//! package-lock.json beside this file by scripts/install-deps.sh --deploy-tools).
//! Input: a JSON array of objects. Output: a JSON array, per object a list of
//! {path, message} (empty: valid). Exit 0 unless the input or the dependencies are unusable.
import fs from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";

// API group -> the npm package holding its models (path <package>/<group>/<version>/<Kind>.js).
const PACKAGES = {
  "monitoring.coreos.com": "@kubernetes-models/prometheus-operator",
  "keda.sh": "@kubernetes-models/keda",
};

const depsDir = path.resolve(process.argv[2] || ".");
const modules = path.join(depsDir, "node_modules");

/** The model class of an apiVersion/kind, or null when the package has no such CRD. */
async function modelOf(apiVersion, kind) {
  const [group, version] = String(apiVersion).split("/");
  const pkg = Object.hasOwn(PACKAGES, group) ? PACKAGES[group] : null;
  if (!pkg || !/^v[0-9a-z]+$/.test(version || "") || !/^[A-Za-z]+$/.test(kind || "")) return null;
  const file = path.join(modules, pkg, group, version, `${kind}.js`);
  if (!fs.existsSync(file)) return null;
  const mod = await import(pathToFileURL(file).href);
  return mod[kind] || null;
}

/** "/spec/groups/0/for" -> "spec.groups.0.for" (JSON pointer escapes undone). */
function dotted(pointer) {
  return pointer.split("/").slice(1).map((p) => p.replace(/~1/g, "/").replace(/~0/g, "~")).join(".");
}

/** The schema pass: the compiled CRD schema's errors (ajv, messages in English). */
function schemaErrors(Model, obj) {
  try {
    new Model(obj).validate();
    return [];
  } catch (err) {
    if (!Array.isArray(err.errors)) throw err;
    const seen = new Set();
    const out = [];
    for (const e of err.errors) {
      let where = dotted(e.instancePath || "");
      if (e.keyword === "required" && e.params?.missingProperty) where = where ? `${where}.${e.params.missingProperty}` : e.params.missingProperty;
      const message = e.keyword === "enum" ? `${e.message}: ${(e.params?.allowedValues || []).join(", ")}` : e.message;
      const key = `${where}\u0000${message}`;
      if (!seen.has(key)) {
        seen.add(key);
        out.push({ path: where || "(root)", message });
      }
    }
    return out;
  }
}

// --- the strict pass ------------------------------------------------------------------------------

let ts;
let checker;
let scalarFlags; // TypeScript types a JSON object can never be
const declared = new Map(); // "<group>/<version>/<Kind>" -> ts.Type of its interface

/** Builds one TypeScript program over the declarations of every kind in `keys`
 * ("monitoring.coreos.com/v1/PodMonitor"). */
async function loadDeclarations(keys) {
  ts = (await import(pathToFileURL(path.join(modules, "typescript/lib/typescript.js")).href)).default;
  const file = path.join(depsDir, "__crdcheck.ts");
  const text = keys
    .map((k, i) => {
      const [group, version, kind] = k.split("/");
      return `import type { I${kind} as T${i} } from "${PACKAGES[group]}/${group}/${version}/${kind}";\nexport type K${i} = T${i};\n`;
    })
    .join("");
  const options = {
    strict: true, noEmit: true, skipLibCheck: true, types: [],
    target: ts.ScriptTarget.ES2022, module: ts.ModuleKind.ESNext, moduleResolution: ts.ModuleResolutionKind.Bundler,
  };
  const host = ts.createCompilerHost(options);
  const getSourceFile = host.getSourceFile.bind(host);
  const fileExists = host.fileExists.bind(host);
  const readFile = host.readFile.bind(host);
  host.getSourceFile = (f, lang, ...rest) => (f === file ? ts.createSourceFile(f, text, lang) : getSourceFile(f, lang, ...rest));
  host.fileExists = (f) => f === file || fileExists(f);
  host.readFile = (f) => (f === file ? text : readFile(f));
  const program = ts.createProgram([file], options, host);
  const problems = ts.getPreEmitDiagnostics(program).map((d) => ts.flattenDiagnosticMessageText(d.messageText, " "));
  if (problems.length) throw new Error(`the CRD declarations do not load: ${problems.join("; ")}`);
  checker = program.getTypeChecker();
  scalarFlags = ts.TypeFlags.StringLike | ts.TypeFlags.NumberLike | ts.TypeFlags.BooleanLike |
    ts.TypeFlags.BigIntLike | ts.TypeFlags.Undefined | ts.TypeFlags.Null | ts.TypeFlags.Void;
  const source = program.getSourceFile(file);
  const aliases = source.statements.filter((s) => ts.isTypeAliasDeclaration(s));
  keys.forEach((k, i) => {
    const alias = aliases.find((a) => a.name.text === `K${i}`);
    declared.set(k, checker.getTypeAtLocation(alias.name));
  });
}

/** Fields of `value` that `type` does not declare, recursively (an open type accepts anything). */
function unknownFields(value, type, where, out) {
  if (value === null || typeof value !== "object") return out; // types are the schema pass's job
  type = checker.getNonNullableType(type);
  if (type.flags & (ts.TypeFlags.Any | ts.TypeFlags.Unknown)) return out;
  if (type.isUnion()) {
    const candidates = type.types.filter((t) => !(t.flags & scalarFlags));
    if (candidates.length === 0) return out;
    // Several object shapes: the one the value fits best (none of them declared the field).
    const tries = candidates.map((t) => unknownFields(value, t, where, []));
    tries.sort((a, b) => a.length - b.length);
    out.push(...tries[0]);
    return out;
  }
  if (Array.isArray(value)) {
    const element = checker.getIndexTypeOfType(type, ts.IndexKind.Number);
    if (element) value.forEach((v, i) => unknownFields(v, element, [...where, i], out));
    return out;
  }
  const mapped = checker.getIndexTypeOfType(type, ts.IndexKind.String);
  if (mapped) {
    for (const [k, v] of Object.entries(value)) unknownFields(v, mapped, [...where, k], out);
    return out;
  }
  const props = checker.getPropertiesOfType(type);
  if (props.length === 0) return out; // a free-form object (x-kubernetes-preserve-unknown-fields)
  for (const [k, v] of Object.entries(value)) {
    const prop = props.find((p) => p.getName() === k);
    if (!prop) {
      out.push({ path: [...where, k].join("."), message: "unknown field (the CRD schema does not declare it)" });
    } else {
      const decl = prop.valueDeclaration || prop.declarations?.[0];
      unknownFields(v, checker.getTypeOfSymbolAtLocation(prop, decl), [...where, k], out);
    }
  }
  return out;
}

// --- main -----------------------------------------------------------------------------------------

async function main() {
  const objects = JSON.parse(fs.readFileSync(0, "utf8"));
  if (!Array.isArray(objects)) throw new Error("expected a JSON array of objects on stdin");
  const models = await Promise.all(objects.map((o) => modelOf(o?.apiVersion, o?.kind)));
  const keys = [...new Set(objects.filter((o, i) => models[i]).map((o) => `${o.apiVersion}/${o.kind}`))];
  if (keys.length) await loadDeclarations(keys);
  const results = objects.map((o, i) => {
    if (!models[i]) return [{ path: "(root)", message: `no CRD schema for ${o?.apiVersion} ${o?.kind} in ${Object.values(PACKAGES).join(", ")}` }];
    const type = declared.get(`${o.apiVersion}/${o.kind}`);
    return [...schemaErrors(models[i], o), ...unknownFields(o, type, [], [])];
  });
  process.stdout.write(JSON.stringify(results));
}

main().catch((err) => {
  process.stderr.write(`crdcheck: ${err.stack || err}\n`);
  process.exit(2);
});
