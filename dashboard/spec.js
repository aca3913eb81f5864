// The job page's spec panel: the resolved spec as one small table per section, each leaf marked
// default or set, with the field's description from the OpenAPI schema.

import { h } from "/dashboard/dom.js";

let schemaPromise = null;
const loadSchema = () => (schemaPromise ||= fetch("/openapi.json").then((r) => r.json()).catch(() => null));

function resolve(schema, defs, value) {
  if (!schema) return null;
  if (schema.$ref) return defs[schema.$ref.split("/").pop()];
  const options = schema.anyOf || schema.oneOf;
  if (options) {
    if (schema.discriminator && value && typeof value === "object") {
      const ref = schema.discriminator.mapping?.[value[schema.discriminator.propertyName]];
      if (ref) return defs[ref.split("/").pop()];
    }
    const ref = options.find((o) => o.$ref);
    if (ref) return defs[ref.$ref.split("/").pop()];
  }
  return schema;
}

const SPEC_GROUPS = ["job", "dataset", "graders", "grpo", "rollout", "eval"];

/** The default a property schema declares; pydantic leaves out `default: null` of optional fields. */
function schemaDefault(schema) {
  if (!schema) return undefined;
  if ("default" in schema) return schema.default;
  if ((schema.anyOf || []).some((o) => o.type === "null")) return null;
  return undefined;
}

function specValue(value) {
  if (typeof value === "string") return value === "" ? '""' : value;
  return JSON.stringify(value);
}

/** The resolved spec as one small table per section; each leaf says whether it is the default. */
export async function renderSpec(box, spec) {
  const openapi = await loadSchema();
  const defs = openapi?.components?.schemas || {};
  const groups = new Map(SPEC_GROUPS.map((g) => [g, []]));
  const add = (path, value, schema) => {
    const top = path.split(/[.[]/)[0];
    const group = groups.has(top) ? top : "job";
    const key = group === "job" ? path : path.slice(top.length).replace(/^\./, "");
    const dflt = schemaDefault(schema);
    const empty = value && typeof value === "object" && !Object.keys(value).length;
    const isDefault = dflt === undefined ? empty : JSON.stringify(dflt) === JSON.stringify(value);
    groups.get(group).push({ key, value, desc: schema?.description, isDefault });
  };
  const walk = (value, schema, path) => {
    const resolved = resolve(schema, defs, value);
    if (Array.isArray(value) && path === "dataset.rows") {
      add(path, `${value.length} inline rows`, schema);
    } else if (Array.isArray(value) && value.length && typeof value[0] === "object") {
      value.forEach((item, i) => walk(item, resolved?.items, `${path}[${i}]`));
    } else if (value && typeof value === "object" && !Array.isArray(value) && resolved?.properties) {
      for (const [k, v] of Object.entries(value)) walk(v, resolved.properties[k], path ? `${path}.${k}` : k);
    } else {
      add(path, value, schema);
    }
  };
  walk(spec, defs.JobSpec || { properties: {} }, "");
  const tables = [...groups].filter(([, rows]) => rows.length).map(([group, rows]) =>
    h("table", { class: "spec" }, h("thead", {}, h("tr", {}, h("th", { colSpan: 2 }, group))),
      h("tbody", {}, rows.map((r) => h("tr", { class: r.isDefault ? "is-default" : "is-set", title: r.desc || "" },
        h("td", { class: "mono small key" }, r.key), h("td", { class: "mono small" }, specValue(r.value)))))));
  box.replaceChildren(h("div", { class: "spec-columns" }, tables));
}
