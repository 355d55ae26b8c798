// Validate AsyncAPI documents with the official parser (@asyncapi/parser).
// Usage: node validate.mjs DOCUMENT.json [...]
// Prints one JSON line per document: {"file", "errors": [...], "warnings": [...]};
// exits 1 when any document has an error-level diagnostic.
import { readFile } from "node:fs/promises";
import { Parser, DiagnosticSeverity } from "@asyncapi/parser";

const parser = new Parser();
let failed = false;
for (const file of process.argv.slice(2)) {
  const text = await readFile(file, "utf8");
  const { document, diagnostics } = await parser.parse(text);
  const shown = (severity) =>
    diagnostics
      .filter((d) => d.severity === severity)
      .map((d) => ({ code: d.code, path: d.path.join("/"), message: d.message }));
  const errors = shown(DiagnosticSeverity.Error);
  if (document === undefined && errors.length === 0) {
    errors.push({ code: "unparsed", path: "", message: "the parser returned no document" });
  }
  failed ||= errors.length > 0;
  console.log(JSON.stringify({ file, errors, warnings: shown(DiagnosticSeverity.Warning) }));
}
process.exit(failed ? 1 : 0);
