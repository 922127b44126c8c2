// The SDK's SHA-256 against FIPS 180-4's examples and node's own digest.
import { createHash } from "node:crypto";
import { sha256Hex } from "./sha256.js";

const encode = (text) => new TextEncoder().encode(text);
const cases = [
  ["", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"],
  ["abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"],
  ["abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq", "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"],
];
for (const [text, want] of cases) {
  const got = sha256Hex(encode(text));
  if (got !== want) throw new Error(`sha256(${JSON.stringify(text)}) = ${got}, want ${want}`);
}
// Every length across two block boundaries, and a megabyte.
for (const length of [...Array(200).keys(), 1 << 20]) {
  const bytes = Uint8Array.from({ length }, (_, i) => (i * 31 + length) & 0xff);
  const want = createHash("sha256").update(bytes).digest("hex");
  const got = sha256Hex(bytes);
  if (got !== want) throw new Error(`length ${length}: ${got}, want ${want}`);
}
console.log("sha256.js: all vectors match");
