//! A baseline JPEG decoder, at full size or at n/8 of it for any n from 1
//! to 7 (libjpeg's `scale_num/8`): at a reduced scale it keeps of each 8×8
//! block the lowest n×n DCT coefficients and inverts just those (the
//! 8-point inverse DCT evaluated at the centres of the reduced pixels,
//! which is libjpeg's n-point inverse DCT), so the cost beyond entropy
//! decoding shrinks with the scale; at full size it runs AAN's 8×8 inverse
//! DCT. Scales 2/8 and 4/8 have butterflies of their own; the others a
//! separable product with a table of the basis. Entropy decoding, which no
//! scale skips, runs over the scan with its byte stuffing removed first,
//! so the bit reader is a plain load and shift. It is written for
//! WebAssembly, where it runs in handlers: no float-to-int conversions per
//! pixel (a long saturating sequence there), and loops the compiler turns
//! into `simd128`.
//!
//! It takes what cameras and encoders mostly write: baseline or extended
//! Huffman, 8-bit, one interleaved scan, grey or YCbCr with sampling
//! factors of 1 or 2. Anything else (progressive, arithmetic coding, 12-bit,
//! CMYK, Adobe RGB, several scans) is `Ok(None)`, for a general decoder to
//! take. Corrupt or truncated data is an error, never a panic.

use std::f32::consts::{FRAC_1_SQRT_2, SQRT_2};

use super::f32x4::{F32x4, pixel};

/// What [`decode`] returns: the reduced pixels.
#[derive(Debug)]
pub struct Reduced {
    /// Width of the reduced image: the original's, divided by the scale, rounded up.
    pub width: u32,
    /// Height of the reduced image, likewise.
    pub height: u32,
    /// Whether `pixels` are grey (one byte a pixel) rather than RGB.
    pub grey: bool,
    /// Row-major pixels.
    pub pixels: Vec<u8>,
    /// The EXIF payload (after `Exif\0\0`), if the file has one.
    pub exif: Option<Vec<u8>>,
}

/// Zigzag position → (row, column) of the coefficient in its block.
const ZIGZAG: [(u8, u8); 64] = {
    let mut table = [(0u8, 0u8); 64];
    let (mut row, mut col, mut k) = (0i32, 0i32, 0usize);
    while k < 64 {
        table[k] = (row as u8, col as u8);
        // Even diagonals run up and right, odd ones down and left.
        if (row + col) % 2 == 0 {
            if col == 7 {
                row += 1;
            } else if row == 0 {
                col += 1;
            } else {
                row -= 1;
                col += 1;
            }
        } else if row == 7 {
            col += 1;
        } else if col == 0 {
            row += 1;
        } else {
            row += 1;
            col -= 1;
        }
        k += 1;
    }
    table
};

/// Bits a Huffman code is looked up by at once.
const LOOKUP_BITS: u32 = 10;

/// One Huffman table, canonical codes as JPEG defines them (Annex C).
#[derive(Clone)]
struct Huffman {
    /// For the next `LOOKUP_BITS` bits: `length << 8 | symbol`, or 0 when the code is longer.
    lookup: Box<[u16; 1 << LOOKUP_BITS]>,
    /// Per length 1..=16: the largest code of that length (−1 when none).
    max_code: [i32; 17],
    /// Per length: what to add to a code to index `symbols`.
    offset: [i32; 17],
    symbols: Vec<u8>,
    /// For the next `LOOKUP_BITS` bits of AC data whose code and value
    /// bits both fit in them: `(value, run, bits used)`; bits used 0 otherwise.
    fast_ac: Box<[(i16, u8, u8); 1 << LOOKUP_BITS]>,
}

impl Huffman {
    /// Builds a table from a DHT segment's 16 counts and its symbols.
    fn new(counts: &[u8; 16], symbols: Vec<u8>) -> Result<Self, String> {
        let mut lookup = Box::new([0u16; 1 << LOOKUP_BITS]);
        let (mut max_code, mut offset) = ([-1i32; 17], [0i32; 17]);
        let (mut code, mut index) = (0i32, 0usize);
        for length in 1..=16u32 {
            let count = usize::from(counts[length as usize - 1]);
            offset[length as usize] = index as i32 - code;
            for _ in 0..count {
                let symbol = *symbols.get(index).ok_or("a Huffman table lists more codes than symbols")?;
                if code >= 1 << length {
                    return Err("a Huffman table has more codes than fit their lengths".into());
                }
                if length <= LOOKUP_BITS {
                    let shift = LOOKUP_BITS - length;
                    let first = (code as usize) << shift;
                    for entry in &mut lookup[first..first + (1 << shift)] {
                        *entry = (length as u16) << 8 | u16::from(symbol);
                    }
                }
                code += 1;
                index += 1;
            }
            if count > 0 {
                max_code[length as usize] = code - 1;
            }
            code <<= 1;
        }
        let fast_ac = Box::new(std::array::from_fn(|index| fast_ac_entry(lookup[index], index)));
        Ok(Self { lookup, max_code, offset, symbols, fast_ac })
    }
}

/// `fast_ac`'s run for the end of a block (EOB).
const END_OF_BLOCK: u8 = 64;

/// The `fast_ac` entry for lookup `index`, whose `lookup` entry is `entry`:
/// a coefficient, sixteen zeros (ZRL: a run of 15 and a zero), or the end
/// of the block ([`END_OF_BLOCK`]).
fn fast_ac_entry(entry: u16, index: usize) -> (i16, u8, u8) {
    let (length, symbol) = (u32::from(entry >> 8), entry as u8);
    let (run, size) = (symbol >> 4, u32::from(symbol & 15));
    match (entry, symbol) {
        (0, _) => return (0, 0, 0),
        (_, 0x00) => return (0, END_OF_BLOCK, length as u8),
        (_, 0xF0) => return (0, 15, length as u8),
        _ => {}
    }
    if size == 0 || length + size > LOOKUP_BITS {
        return (0, 0, 0);
    }
    let bits = ((index >> (LOOKUP_BITS - length - size)) & ((1 << size) - 1)) as i32;
    let value = if bits < 1 << (size - 1) { bits - (1 << size) + 1 } else { bits };
    (value as i16, run, (length + size) as u8)
}

/// Reads bits, most significant first, from entropy-coded data whose
/// stuffing is already removed; reads past the end give zeros.
#[derive(Clone, Copy)]
struct Bits<'a> {
    data: &'a [u8],
    /// The next byte to load.
    next: usize,
    /// Bits not yet consumed, at the top; below them, more of the stream.
    buffer: u64,
    /// How many of `buffer`'s top bits are loaded.
    count: u32,
}

impl<'a> Bits<'a> {
    fn new(data: &'a [u8], byte: usize) -> Self {
        Self { data, next: byte, buffer: 0, count: 0 }
    }

    /// Bits consumed so far, from the start of `data`.
    fn position(&self) -> usize {
        self.next * 8 - self.count as usize
    }

    /// Loads whole bytes until at least 56 bits are loaded. The bits it
    /// also ORs in below them are the stream's next ones, so loading them
    /// again later changes nothing.
    #[inline(always)]
    fn refill(&mut self) {
        let word = match self.data.get(self.next..self.next + 8) {
            Some(b) => u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]),
            None => tail_word(self.data, self.next),
        };
        self.buffer |= word >> self.count;
        let bytes = (63 - self.count) >> 3;
        self.next += bytes as usize;
        self.count += bytes * 8;
    }

    /// The next `n` bits (1..=32), not consumed; at least `n` must be loaded.
    #[inline(always)]
    fn peek(&self, n: u32) -> u32 {
        (self.buffer >> (64 - n)) as u32
    }

    #[inline(always)]
    fn skip(&mut self, n: u32) {
        self.buffer <<= n;
        self.count -= n;
    }

    /// A Huffman symbol; leaves at least 16 bits loaded for its value.
    #[inline(always)]
    fn symbol(&mut self, table: &Huffman) -> Result<u8, String> {
        if self.count < 32 {
            self.refill();
        }
        let bits = self.peek(16);
        let entry = table.lookup[(bits >> (16 - LOOKUP_BITS)) as usize];
        if entry != 0 {
            self.skip(u32::from(entry >> 8));
            return Ok(entry as u8);
        }
        for length in LOOKUP_BITS + 1..=16 {
            let code = (bits >> (16 - length)) as i32;
            if code <= table.max_code[length as usize] {
                self.skip(length);
                let index = (code + table.offset[length as usize]) as usize;
                return table.symbols.get(index).copied().ok_or_else(|| "corrupt JPEG data: bad Huffman code".to_owned());
            }
        }
        Err("corrupt JPEG data: bad Huffman code".into())
    }

    /// `size` bits as a signed coefficient (JPEG's EXTEND, F.2.2.1); at
    /// most 16, and called right after [`Bits::symbol`], which left at
    /// least 16 loaded.
    #[inline(always)]
    fn value(&mut self, size: u8) -> i32 {
        if size == 0 {
            return 0;
        }
        let size = u32::from(size.min(16));
        let bits = self.peek(size) as i32;
        self.skip(size);
        if bits < 1 << (size - 1) { bits - (1 << size) + 1 } else { bits }
    }
}

/// The 8 bytes of `data` from `next` near its end, zeros past it. Not a
/// method: a call that took the reader by reference would keep it in
/// memory (in wasm, the shadow stack) instead of in registers.
#[cold]
fn tail_word(data: &[u8], next: usize) -> u64 {
    let mut word = [0u8; 8];
    for (i, b) in word.iter_mut().enumerate() {
        *b = data.get(next + i).copied().unwrap_or(0);
    }
    u64::from_be_bytes(word)
}

/// One component of the frame, and where its blocks go.
#[derive(Clone, Debug)]
struct Component {
    id: u8,
    h: usize,
    v: usize,
    quant: usize,
    dc: usize,
    ac: usize,
}

#[derive(Default)]
struct Tables {
    quant: [Option<[u16; 64]>; 4],
    dc: [Option<Huffman>; 4],
    ac: [Option<Huffman>; 4],
}

struct Frame {
    width: usize,
    height: usize,
    components: Vec<Component>,
}

/// Decodes `bytes` at `eighths`/8 of its size (`eighths` 1 to 8, 8 being
/// full size; each side rounded up, as libjpeg does); `None` when the file
/// uses a feature this decoder leaves to others. Fails on corrupt or
/// truncated data, or when the planes would need more than `max_bytes`.
pub fn decode(bytes: &[u8], eighths: usize, max_bytes: u64) -> Result<Option<Reduced>, String> {
    if !(1..=8).contains(&eighths) || bytes.get(..2) != Some(&[0xFF, 0xD8]) {
        return Ok(None);
    }
    let (mut tables, mut frame, mut restart, mut exif, mut adobe_rgb) = (Tables::default(), None, 0usize, None, false);
    let mut at = 2;
    loop {
        let (marker, segment, next) = next_segment(bytes, at)?;
        at = next;
        match marker {
            0xC0 | 0xC1 => match parse_frame(segment)? {
                Some(parsed) => frame = Some(parsed),
                None => return Ok(None),
            },
            0xC2 | 0xC3 | 0xC5..=0xC7 | 0xC9..=0xCB | 0xCD..=0xCF => return Ok(None),
            0xC4 => parse_huffman(segment, &mut tables)?,
            0xDB => parse_quant(segment, &mut tables)?,
            0xDD => restart = usize::from(u16::from_be_bytes([*segment.first().unwrap_or(&0), *segment.get(1).unwrap_or(&0)])),
            0xE1 if segment.starts_with(b"Exif\0\0") => exif = Some(segment[6..].to_vec()),
            0xEE if segment.starts_with(b"Adobe") && segment.len() >= 12 => adobe_rgb = segment[11] == 0,
            0xDA => {
                let Some(frame) = frame.as_mut() else { return Err("a JPEG scan before its frame header".into()) };
                // RGB rather than YCbCr: said by Adobe's marker, or by component ids R, G, B.
                let ids: Vec<u8> = frame.components.iter().map(|c| c.id).collect();
                if frame.components.len() == 3 && (adobe_rgb || ids == b"RGB") {
                    return Ok(None);
                }
                if !parse_scan(segment, frame)? {
                    return Ok(None);
                }
                let mut reduced = decode_scan(&bytes[at..], frame, &tables, restart, eighths, max_bytes)?;
                reduced.exif = exif;
                return Ok(Some(reduced));
            }
            0xD9 => return Err("the JPEG ends before any scan".into()),
            _ => {}
        }
    }
}

/// The marker at `at` (fill bytes skipped), its segment's payload and where the next one starts.
fn next_segment(bytes: &[u8], mut at: usize) -> Result<(u8, &[u8], usize), String> {
    let truncated = || "truncated JPEG header".to_owned();
    if bytes.get(at) != Some(&0xFF) {
        return Err("corrupt JPEG header: a marker expected".into());
    }
    while bytes.get(at) == Some(&0xFF) {
        at += 1;
    }
    let marker = *bytes.get(at).ok_or_else(truncated)?;
    at += 1;
    if matches!(marker, 0xD8 | 0xD9 | 0x01 | 0xD0..=0xD7) {
        return Ok((marker, &[], at));
    }
    let length = usize::from(u16::from_be_bytes([*bytes.get(at).ok_or_else(truncated)?, *bytes.get(at + 1).ok_or_else(truncated)?]));
    let segment = bytes.get(at + 2..at + length.max(2)).ok_or_else(truncated)?;
    Ok((marker, segment, at + length.max(2)))
}

fn parse_frame(segment: &[u8]) -> Result<Option<Frame>, String> {
    let short = || "short JPEG frame header".to_owned();
    let header = segment.get(..6).ok_or_else(short)?;
    let (precision, height, width, count) = (
        header[0],
        usize::from(u16::from_be_bytes([header[1], header[2]])),
        usize::from(u16::from_be_bytes([header[3], header[4]])),
        header[5],
    );
    if precision != 8 || height == 0 || width == 0 || !matches!(count, 1 | 3) {
        return Ok(None);
    }
    let mut components = Vec::new();
    for c in segment.get(6..6 + 3 * usize::from(count)).ok_or_else(short)?.chunks_exact(3) {
        let (h, v, quant) = (usize::from(c[1] >> 4), usize::from(c[1] & 15), usize::from(c[2]));
        if !(1..=2).contains(&h) || !(1..=2).contains(&v) || quant > 3 {
            return Ok(None);
        }
        components.push(Component { id: c[0], h, v, quant, dc: 0, ac: 0 });
    }
    if count == 1 {
        // A single component is not interleaved: one block an MCU, whatever its factors say.
        components[0].h = 1;
        components[0].v = 1;
    }
    Ok(Some(Frame { width, height, components }))
}

fn parse_huffman(mut segment: &[u8], tables: &mut Tables) -> Result<(), String> {
    while !segment.is_empty() {
        let short = || "short JPEG Huffman table".to_owned();
        let class_id = segment[0];
        let counts: [u8; 16] = segment.get(1..17).ok_or_else(short)?.try_into().map_err(|_| short())?;
        let total: usize = counts.iter().map(|&c| usize::from(c)).sum();
        let symbols = segment.get(17..17 + total).ok_or_else(short)?.to_vec();
        let (class, id) = (class_id >> 4, usize::from(class_id & 15));
        if id > 3 || class > 1 {
            return Err("bad JPEG Huffman table id".into());
        }
        let table = Some(Huffman::new(&counts, symbols)?);
        if class == 0 {
            tables.dc[id] = table;
        } else {
            tables.ac[id] = table;
        }
        segment = &segment[17 + total..];
    }
    Ok(())
}

fn parse_quant(mut segment: &[u8], tables: &mut Tables) -> Result<(), String> {
    while !segment.is_empty() {
        let (precision, id) = (segment[0] >> 4, usize::from(segment[0] & 15));
        let size = if precision == 0 { 64 } else { 128 };
        let values = segment.get(1..1 + size).ok_or("short JPEG quantisation table")?;
        if id > 3 || precision > 1 {
            return Err("bad JPEG quantisation table id".into());
        }
        let mut table = [0u16; 64];
        for (k, q) in table.iter_mut().enumerate() {
            *q = if precision == 0 { u16::from(values[k]) } else { u16::from_be_bytes([values[2 * k], values[2 * k + 1]]) };
        }
        tables.quant[id] = Some(table);
        segment = &segment[1 + size..];
    }
    Ok(())
}

/// Reads a scan header into the frame's table choices; false when the scan
/// is not one baseline scan of every component.
fn parse_scan(segment: &[u8], frame: &mut Frame) -> Result<bool, String> {
    let count = usize::from(*segment.first().ok_or("short JPEG scan header")?);
    let selectors = segment.get(1..1 + 2 * count).ok_or("short JPEG scan header")?;
    let spectral = segment.get(1 + 2 * count..4 + 2 * count).ok_or("short JPEG scan header")?;
    if count != frame.components.len() || spectral != [0, 63, 0] {
        return Ok(false);
    }
    for (component, selector) in frame.components.iter_mut().zip(selectors.chunks_exact(2)) {
        if component.id != selector[0] {
            return Ok(false);
        }
        (component.dc, component.ac) = (usize::from(selector[1] >> 4), usize::from(selector[1] & 15));
        if component.dc > 3 || component.ac > 3 {
            return Err("bad JPEG Huffman table selector".into());
        }
    }
    Ok(true)
}

/// The entropy-coded data from `bytes` on, stuffing removed, split at
/// restart markers: the data and where each interval starts in it.
/// Errors if no marker ends the data (a truncated file).
fn unstuff(bytes: &[u8]) -> Result<(Vec<u8>, Vec<usize>), String> {
    let mut data = Vec::with_capacity(bytes.len() + 8);
    let mut starts = vec![0];
    let mut at = 0;
    loop {
        // memchr: SIMD (simd128 in wasm) over the long runs between markers.
        let run = memchr::memchr(0xFF, &bytes[at..]).ok_or("truncated JPEG data")?;
        data.extend_from_slice(&bytes[at..at + run]);
        at += run;
        match bytes.get(at + 1) {
            Some(0x00) => {
                data.push(0xFF);
                at += 2;
            }
            Some(0xFF) => at += 1,
            Some(0xD0..=0xD7) => {
                starts.push(data.len());
                at += 2;
            }
            Some(_) => return Ok((data, starts)),
            None => return Err("truncated JPEG data".into()),
        }
    }
}

/// Per component: its reduced plane and the plane's width.
struct Planes {
    planes: Vec<Vec<u8>>,
    widths: Vec<usize>,
}

/// How a frame's MCUs lie: `n`×`n` pixels a block, the largest sampling
/// factors, and the MCUs across and down.
struct Layout {
    n: usize,
    h_max: usize,
    v_max: usize,
    mcus_x: usize,
    mcus_y: usize,
}

impl Layout {
    fn new(frame: &Frame, eighths: usize) -> Self {
        let h_max = frame.components.iter().map(|c| c.h).max().unwrap_or(1);
        let v_max = frame.components.iter().map(|c| c.v).max().unwrap_or(1);
        let (mcus_x, mcus_y) = (frame.width.div_ceil(8 * h_max), frame.height.div_ceil(8 * v_max));
        Self { n: eighths, h_max, v_max, mcus_x, mcus_y }
    }

    /// The width and height of a component's plane.
    fn plane(&self, c: &Component) -> (usize, usize) {
        (self.mcus_x * c.h * self.n, self.mcus_y * c.v * self.n)
    }
}

fn decode_scan(bytes: &[u8], frame: &Frame, tables: &Tables, restart: usize, eighths: usize, max_bytes: u64) -> Result<Reduced, String> {
    let layout = Layout::new(frame, eighths);
    let (out_w, out_h) = ((frame.width * eighths).div_ceil(8), (frame.height * eighths).div_ceil(8));
    // In u64: on wasm32 a usize product of a huge header's sizes could wrap.
    let plane_bytes: u64 = frame.components.iter().map(|c| layout.plane(c)).map(|(w, h)| w as u64 * h as u64).sum();
    let out_bytes = out_w as u64 * out_h as u64 * frame.components.len() as u64;
    if plane_bytes + out_bytes + bytes.len() as u64 > max_bytes {
        return Err("the JPEG needs more memory than allowed to decode".into());
    }
    let mut codings = Vec::new();
    for c in &frame.components {
        let quant = tables.quant[c.quant].ok_or("a JPEG component uses a quantisation table never defined")?;
        let dc = tables.dc[c.dc].as_ref().ok_or("a JPEG component uses a Huffman table never defined")?;
        let ac = tables.ac[c.ac].as_ref().ok_or("a JPEG component uses a Huffman table never defined")?;
        codings.push(Coding { dc, ac, quant: dequantiser(&quant, layout.n) });
    }
    let mut planes = Planes {
        planes: frame.components.iter().map(|c| layout.plane(c)).map(|(w, h)| vec![0u8; w * h]).collect(),
        widths: frame.components.iter().map(|c| layout.plane(c).0).collect(),
    };
    let (data, starts) = unstuff(bytes)?;
    let scan = Scan { data: &data, starts: &starts, restart };
    let n = layout.n;
    if n == 8 {
        decode_mcus(&scan, frame, &codings, &layout, &mut planes, write_full)?;
    } else {
        let basis = Basis::new(n);
        decode_mcus(&scan, frame, &codings, &layout, &mut planes, |z, used, q, plane, stride| {
            write_reduced(z, used, q, &basis, plane, stride)
        })?;
    }
    let pixels = to_output(&planes, frame, &layout, out_w, out_h);
    let grey = frame.components.len() == 1;
    Ok(Reduced { width: out_w as u32, height: out_h as u32, grey, pixels, exif: None })
}

/// How a component's blocks are coded: its DC and AC Huffman tables and
/// its dequantiser (see [`dequantiser`]).
struct Coding<'a> {
    dc: &'a Huffman,
    ac: &'a Huffman,
    quant: [f32; 64],
}

/// The entropy-coded data, stuffing removed, with where each restart
/// interval starts in it and the interval's length in MCUs (0: none).
struct Scan<'a> {
    data: &'a [u8],
    starts: &'a [usize],
    restart: usize,
}

/// The scan's MCUs: each block's coefficients decoded into one zigzag
/// array, which `write` dequantises, inverts into its component's plane and
/// leaves zero where it reads (see [`decode_block`]).
fn decode_mcus(
    scan: &Scan<'_>,
    frame: &Frame,
    codings: &[Coding<'_>],
    layout: &Layout,
    planes: &mut Planes,
    write: impl Fn(&mut [i32; 64], usize, &[f32; 64], &mut [u8], usize),
) -> Result<(), String> {
    let Scan { data, starts, restart } = *scan;
    let mut bits = Bits::new(data, 0);
    let mut predictors = vec![0i32; frame.components.len()];
    let mut zigzag = [0i32; 64];
    let (mut interval, mut left) = (0usize, restart);
    let mut end = starts.get(1).copied().unwrap_or(data.len()) * 8;
    for my in 0..layout.mcus_y {
        for mx in 0..layout.mcus_x {
            if restart > 0 && left == 0 {
                // The next interval starts byte-aligned, its predictors at zero.
                interval += 1;
                let start = *starts.get(interval).ok_or("corrupt JPEG data: a restart marker is missing")?;
                bits = Bits::new(data, start);
                end = starts.get(interval + 1).copied().unwrap_or(data.len()) * 8;
                predictors.iter_mut().for_each(|p| *p = 0);
                left = restart;
            }
            left = left.wrapping_sub(1);
            for (index, c) in frame.components.iter().enumerate() {
                let Coding { dc, ac, quant } = &codings[index];
                let width = planes.widths[index];
                for by in 0..c.v {
                    for bx in 0..c.h {
                        let used = decode_block(&mut bits, (dc, ac), &mut predictors[index], &mut zigzag)?;
                        let origin = ((my * c.v + by) * layout.n) * width + (mx * c.h + bx) * layout.n;
                        write(&mut zigzag, used, quant, &mut planes.planes[index][origin..], width);
                    }
                }
            }
            if bits.position() > end {
                return Err("corrupt JPEG data: it ends before the image does".into());
            }
        }
    }
    Ok(())
}

/// AAN's scale factors, `cos(kπ/16)·√2` (1 for k = 0 and 4), which the
/// 8×8 inverse DCT ([`idct_8_columns`]) expects folded into the
/// coefficients.
const AAN_SCALE: [f32; 8] = [1.0, 1.387_039_8, 1.306_563, 1.175_875_6, 1.0, 0.785_695, 0.541_196_1, 0.275_899_38];

/// A quantisation table (zigzag order) as the factors that dequantise a
/// block's coefficients for the inverse DCT of an `n`×`n` block: for 8×8,
/// in zigzag order with AAN's scale factors and the transform's 1/8 folded
/// in; at 2×2 and 4×4, those of the lowest 4×4 in [`LOW_4X4`]'s order (the
/// rest unused); at the other reduced sizes, in natural (row-major) order.
fn dequantiser(quant: &[u16; 64], n: usize) -> [f32; 64] {
    std::array::from_fn(|i| match n {
        8 => {
            let (row, col) = ZIGZAG[i];
            f32::from(quant[i]) * AAN_SCALE[usize::from(row)] * AAN_SCALE[usize::from(col)] / 8.0
        }
        2 | 4 => LOW_4X4.get(i).map_or(0.0, |&k| f32::from(quant[usize::from(k)])),
        _ => f32::from(quant[usize::from(NATURAL_TO_ZIGZAG[i])]),
    })
}

/// Natural (row-major) position → zigzag position of a block's coefficient.
const NATURAL_TO_ZIGZAG: [u8; 64] = {
    let mut table = [0u8; 64];
    let mut k = 0;
    while k < 64 {
        let (row, col) = ZIGZAG[k];
        table[row as usize * 8 + col as usize] = k as u8;
        k += 1;
    }
    table
};

/// The 8-point inverse DCT's basis sampled at the centres of `n` reduced
/// pixels: `at[x][u] = ½·C(u)·cos((2x+1)uπ/2n)`, C(0) = 1/√2, else 1, so a
/// block's pixel (y, x) is Σv Σu at[y][v]·at[x][u]·F(v, u).
struct Basis {
    n: usize,
    at: [[f32; 8]; 8],
}

impl Basis {
    fn new(n: usize) -> Self {
        let at = std::array::from_fn(|x| {
            std::array::from_fn(|u| {
                let c = if u == 0 { FRAC_1_SQRT_2 } else { 1.0 };
                let angle = (2 * x + 1) as f64 * u as f64 * std::f64::consts::PI / (2 * n.max(1)) as f64;
                (0.5 * f64::from(c) * angle.cos()) as f32
            })
        });
        Self { n, at }
    }
}

/// The zigzag positions of a block's lowest 4×4 coefficients, column by
/// column: entry `4·u + v` is row `v`, column `u`. Columns first, so that
/// each column's four coefficients are one vector in [`write_4`].
const LOW_4X4: [u8; 16] = {
    let mut positions = [0u8; 16];
    let mut k = 0;
    while k < 64 {
        let (row, col) = ZIGZAG[k];
        if row < 4 && col < 4 {
            positions[col as usize * 4 + row as usize] = k as u8;
        }
        k += 1;
    }
    positions
};

/// Decodes one block's coefficients into `zigzag` (zigzag order, not
/// dequantised), where every position the caller reads must be zero on
/// entry; writes only below the position it returns, the end of the
/// block's coefficients (1 when it has only DC).
///
/// Nothing here depends on the scale: which coefficients a reduced scale
/// keeps is left to the caller, so keeping or dropping one is neither a
/// branch (at a reduced scale it follows the image and mispredicts) nor a
/// look-up per coefficient.
///
/// It works on a copy of the reader, written back at the end, and nothing
/// in the loop takes the reader's address, so in wasm its state stays in
/// locals (registers) rather than in the shadow stack. As a function of
/// its own, not inlined, it measured 7 % slower in wasm: the call and the
/// result through memory cost more than the register pressure it relieved.
#[inline(always)]
fn decode_block(bits: &mut Bits<'_>, tables: (&Huffman, &Huffman), predictor: &mut i32, zigzag: &mut [i32; 64]) -> Result<usize, String> {
    let mut reader = *bits;
    let used = decode_coefficients(&mut reader, tables, predictor, zigzag)?;
    *bits = reader;
    Ok(used)
}

/// [`decode_block`]'s work.
#[inline(always)]
fn decode_coefficients(
    bits: &mut Bits<'_>,
    (dc, ac): (&Huffman, &Huffman),
    predictor: &mut i32,
    zigzag: &mut [i32; 64],
) -> Result<usize, String> {
    let size = bits.symbol(dc)?;
    if size > 11 {
        return Err("corrupt JPEG data: DC difference too large".into());
    }
    *predictor = predictor.wrapping_add(bits.value(size));
    zigzag[0] = *predictor;
    let mut k = 1;
    while k < 64 {
        if bits.count < 32 {
            bits.refill();
        }
        let (fast_value, fast_run, used) = ac.fast_ac[bits.peek(LOOKUP_BITS) as usize];
        let value = if used != 0 {
            bits.skip(u32::from(used));
            if fast_run == END_OF_BLOCK {
                break;
            }
            k += usize::from(fast_run);
            i32::from(fast_value)
        } else {
            let symbol = bits.symbol(ac)?;
            let (run, size) = (usize::from(symbol >> 4), symbol & 15);
            if size == 0 {
                if run != 15 {
                    break;
                }
                k += 16;
                continue;
            }
            k += run;
            bits.value(size)
        };
        if k > 63 {
            return Err("corrupt JPEG data: coefficient past the block".into());
        }
        zigzag[k] = value;
        k += 1;
    }
    Ok(k.min(64))
}

/// `write` at a reduced scale: the block's lowest `n`×`n` coefficients
/// dequantised, inverted at the centres of the `n`×`n` reduced pixels into
/// `plane` at its start, rows `stride` apart; a block with only DC (or no
/// kept AC) is flat. Reads (and leaves zero) only the `n`×`n` positions.
#[inline(always)]
fn write_reduced(zigzag: &mut [i32; 64], used: usize, quant: &[f32; 64], basis: &Basis, plane: &mut [u8], stride: usize) {
    let n = basis.n;
    if used == 1 || n == 1 {
        // The kept AC positions were left zero and `used` says none was written.
        let dc = std::mem::take(&mut zigzag[0]) as f32 * quant[0];
        return fill(plane, stride, n, pixel(dc / 8.0));
    }
    if n == 2 {
        // The 2×2's entries of the 4×4 column by column.
        let raw = [0, 1, 4, 5].map(|i| (std::mem::take(&mut zigzag[usize::from(LOW_4X4[i])]), quant[i]));
        return match raw {
            [(dc, q), (0, _), (0, _), (0, _)] => fill(plane, stride, 2, pixel(dc as f32 * q / 8.0)),
            _ => write_2(raw.map(|(value, q)| value as f32 * q), plane, stride),
        };
    }
    match n {
        3 => return write_n::<3>(zigzag, quant, basis, plane, stride),
        5 => return write_n::<5>(zigzag, quant, basis, plane, stride),
        6 => return write_n::<6>(zigzag, quant, basis, plane, stride),
        7 => return write_n::<7>(zigzag, quant, basis, plane, stride),
        _ => {}
    }
    // Column by column (see [`LOW_4X4`]).
    let raw: [i32; 16] = std::array::from_fn(|i| std::mem::take(&mut zigzag[usize::from(LOW_4X4[i])]));
    let f: [f32; 16] = std::array::from_fn(|i| raw[i] as f32 * quant[i]);
    if raw[1..].iter().any(|&v| v != 0) { write_4(&f, plane, stride) } else { fill(plane, stride, 4, pixel(f[0] / 8.0)) }
}

/// `write` at full size: all 64 coefficients dequantised (the transform's
/// 1/8 folded in by the dequantiser) into natural order and inverted;
/// zeroes what the block used.
#[inline(always)]
fn write_full(zigzag: &mut [i32; 64], used: usize, quant: &[f32; 64], plane: &mut [u8], stride: usize) {
    let mut f = [0f32; 64];
    for k in 0..used.min(64) {
        let (row, col) = ZIGZAG[k];
        f[usize::from(row) * 8 + usize::from(col)] = std::mem::take(&mut zigzag[k]) as f32 * quant[k];
    }
    if used > 1 { write_8(&f, plane, stride) } else { fill(plane, stride, 8, pixel(f[0])) }
}

/// A flat `n`×`n` block.
#[inline(always)]
fn fill(plane: &mut [u8], stride: usize, n: usize, value: u8) {
    for y in 0..n {
        plane[y * stride..y * stride + n].fill(value);
    }
}

/// [`write_reduced`] for the sizes without butterflies of their own (3, 5,
/// 6, 7): the lowest `N`×`N` coefficients (`quant` in natural order),
/// across each coefficient row, then down each pixel column, by the table.
/// `N` is a constant so that the products unroll.
#[inline(always)]
fn write_n<const N: usize>(zigzag: &mut [i32; 64], quant: &[f32; 64], basis: &Basis, plane: &mut [u8], stride: usize) {
    let mut f = [[0f32; N]; N];
    let mut ac = false;
    for (v, row) in f.iter_mut().enumerate() {
        for (u, value) in row.iter_mut().enumerate() {
            let raw = std::mem::take(&mut zigzag[usize::from(NATURAL_TO_ZIGZAG[v * 8 + u])]);
            ac |= raw != 0 && v + u > 0;
            *value = raw as f32 * quant[v * 8 + u];
        }
    }
    if !ac {
        return fill(plane, stride, N, pixel(f[0][0] / 8.0));
    }
    let at: [[f32; N]; N] = std::array::from_fn(|x| std::array::from_fn(|u| basis.at[x][u]));
    // across[v][x]: coefficient row v sampled at pixel column x.
    let across: [[f32; N]; N] = std::array::from_fn(|v| std::array::from_fn(|x| (0..N).fold(0.0, |sum, u| sum + f[v][u] * at[x][u])));
    for (y, weights) in at.iter().enumerate() {
        let row = &mut plane[y * stride..y * stride + N];
        for (x, value) in row.iter_mut().enumerate() {
            *value = pixel((0..N).fold(0.0, |sum, v| sum + across[v][x] * weights[v]));
        }
    }
}

/// [`write_reduced`] for 2×2 (`f` column by column: rows 0 and 1 of
/// column 0, then of column 1): x_k = ½·(F(0)/√2 ± F(1)·cos(π/4)) each way.
#[inline(always)]
fn write_2(f: [f32; 4], plane: &mut [u8], stride: usize) {
    let idct_2 = |f0: f32, f1: f32| [(f0 + f1) * 0.5 * FRAC_1_SQRT_2, (f0 - f1) * 0.5 * FRAC_1_SQRT_2];
    // Down each coefficient column first, then across.
    let (left, right) = (idct_2(f[0], f[1]), idct_2(f[2], f[3]));
    for y in 0..2 {
        let row = idct_2(left[y], right[y]);
        plane[y * stride] = pixel(row[0]);
        plane[y * stride + 1] = pixel(row[1]);
    }
}

/// [`write_reduced`] for 4×4 (`f` column by column, see [`LOW_4X4`]), by
/// butterflies on four lanes: across, for the four coefficient rows at
/// once, then down, for the four pixel columns at once.
#[inline(always)]
fn write_4(f: &[f32; 16], plane: &mut [u8], stride: usize) {
    // columns[u]: coefficient column u, a lane per coefficient row.
    let columns: [F32x4; 4] = std::array::from_fn(|u| F32x4::new(std::array::from_fn(|v| f[u * 4 + v])));
    // idct_4_lanes(columns)[x]: sample x across each coefficient row;
    // transposed, a vector per coefficient row, a lane per pixel column.
    let across = F32x4::transpose(idct_4_lanes(columns));
    // rows[y]: pixel row y, a lane per pixel column.
    let rows = idct_4_lanes(across);
    for (y, pixels) in F32x4::pixels(rows).iter().enumerate() {
        plane[y * stride..y * stride + 4].copy_from_slice(pixels);
    }
}

/// The 8-point inverse DCT of the four lowest coefficients, evaluated at
/// the centres of four pixel pairs, x_k = ½·Σu C(u)·F(u)·cos((2k+1)uπ/8),
/// for four lanes at once: `f[u]` holds coefficient `u` of each lane; the
/// result's `[k]` holds sample `k` of each lane.
#[inline(always)]
fn idct_4_lanes(f: [F32x4; 4]) -> [F32x4; 4] {
    const C1: f32 = 0.923_879_5; // cos(π/8)
    const C3: f32 = 0.382_683_43; // cos(3π/8)
    let even = (f[0] + f[2]) * FRAC_1_SQRT_2;
    let even_2 = (f[0] - f[2]) * FRAC_1_SQRT_2;
    let odd = f[1] * C1 + f[3] * C3;
    let odd_2 = f[1] * C3 - f[3] * C1;
    [(even + odd) * 0.5, (even_2 + odd_2) * 0.5, (even_2 - odd_2) * 0.5, (even - odd) * 0.5]
}

/// [`write_full`]'s transform: AAN's inverse DCT (libjpeg's `jidctflt.c`),
/// both passes run down columns, so each handles the block's eight
/// columns at once (SIMD where the target has it).
#[inline(always)]
fn write_8(f: &[f32; 64], plane: &mut [u8], stride: usize) {
    let mut columns = [0f32; 64];
    idct_8_columns(f, &mut columns);
    let transposed: [f32; 64] = std::array::from_fn(|i| columns[(i % 8) * 8 + i / 8]);
    let mut out = [0f32; 64];
    idct_8_columns(&transposed, &mut out);
    // Converted in place (SIMD), then placed: bytes[x·8 + y] is the pixel at column x, row y.
    let bytes: [u8; 64] = std::array::from_fn(|i| pixel(out[i]));
    for y in 0..8 {
        for (x, value) in plane[y * stride..y * stride + 8].iter_mut().enumerate() {
            *value = bytes[x * 8 + y];
        }
    }
}

/// The 1-D 8-point inverse DCT (AAN, inputs scaled by [`AAN_SCALE`]) of
/// each of the eight columns of `input` (row-major 8×8) into `out`.
#[inline(always)]
fn idct_8_columns(input: &[f32; 64], out: &mut [f32; 64]) {
    for x in 0..8 {
        let i = |u: usize| input[u * 8 + x];
        // Even part.
        let (tmp10, tmp11) = (i(0) + i(4), i(0) - i(4));
        let tmp13 = i(2) + i(6);
        let tmp12 = (i(2) - i(6)) * SQRT_2 - tmp13;
        let (e0, e3, e1, e2) = (tmp10 + tmp13, tmp10 - tmp13, tmp11 + tmp12, tmp11 - tmp12);
        // Odd part.
        let (z13, z10, z11, z12) = (i(5) + i(3), i(5) - i(3), i(1) + i(7), i(1) - i(7));
        let o7 = z11 + z13;
        let o11 = (z11 - z13) * SQRT_2;
        let z5 = (z10 + z12) * 1.847_759;
        let o10 = 1.082_392_2 * z12 - z5;
        let o12 = -2.613_126 * z10 + z5;
        let o6 = o12 - o7;
        let o5 = o11 - o6;
        let o4 = o10 + o5;
        out[x] = e0 + o7;
        out[7 * 8 + x] = e0 - o7;
        out[8 + x] = e1 + o6;
        out[6 * 8 + x] = e1 - o6;
        out[2 * 8 + x] = e2 + o5;
        out[5 * 8 + x] = e2 - o5;
        out[4 * 8 + x] = e3 + o4;
        out[3 * 8 + x] = e3 - o4;
    }
}

/// The planes as grey or RGB pixels of the reduced size: planes of lower
/// sampling interpolated up (see [`upsample_row`]), YCbCr converted as JFIF
/// defines it.
fn to_output(planes: &Planes, frame: &Frame, layout: &Layout, width: usize, height: usize) -> Vec<u8> {
    if frame.components.len() == 1 {
        let (plane, stride) = (&planes.planes[0], planes.widths[0]);
        let mut out = Vec::with_capacity(width * height);
        for y in 0..height {
            out.extend_from_slice(&plane[y * stride..y * stride + width]);
        }
        return out;
    }
    let mut out = vec![0u8; width * height * 3];
    // Sampling factors are 1 or 2: a plane of lower sampling has half the pixels that way.
    let halved: Vec<(bool, bool)> = frame.components.iter().map(|c| (c.h < layout.h_max, c.v < layout.v_max)).collect();
    let mut rows = [vec![0u8; width], vec![0u8; width], vec![0u8; width]];
    let mut sums = Vec::new();
    for y in 0..height {
        for (index, row) in rows.iter_mut().enumerate() {
            upsample_row(&planes.planes[index], planes.widths[index], halved[index], y, row, &mut sums);
        }
        let [luma, blue, red] = &rows;
        ycbcr_to_rgb(luma, blue, red, &mut out[y * width * 3..(y + 1) * width * 3]);
    }
    out
}

/// JFIF's YCbCr to RGB of one row: eight pixels at a time with `simd128`
/// where the target has it, the rest one by one.
fn ycbcr_to_rgb(luma: &[u8], blue: &[u8], red: &[u8], out: &mut [u8]) {
    let done = ycbcr_to_rgb_simd(luma, blue, red, out);
    let pixels = out[done * 3..].chunks_exact_mut(3);
    for (pixel, ((&l, &b), &r)) in pixels.zip(luma[done..].iter().zip(&blue[done..]).zip(&red[done..])) {
        let l = i32::from(l) << 16;
        let (b, r) = (i32::from(b) - 128, i32::from(r) - 128);
        // 1.402, 0.344136, 0.714136 and 1.772, in 16-bit fixed point.
        pixel[0] = ((l + 91881 * r + 32768) >> 16).clamp(0, 255) as u8;
        pixel[1] = ((l - 22554 * b - 46802 * r + 32768) >> 16).clamp(0, 255) as u8;
        pixel[2] = ((l + 116130 * b + 32768) >> 16).clamp(0, 255) as u8;
    }
}

/// [`ycbcr_to_rgb`]'s first pixels, a multiple of eight, in 16-bit lanes:
/// the coefficients' fractions by Q15 rounding multiplies (1.402 as
/// 1 + 0.402, 1.772 as 2 − 0.228), saturated to bytes, and interleaved by
/// two shuffles. Returns how many pixels it converted. LLVM does not
/// vectorise the interleaved scalar loop, and in WebAssembly colour
/// conversion was over a quarter of a full-size decode.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
fn ycbcr_to_rgb_simd(luma: &[u8], blue: &[u8], red: &[u8], out: &mut [u8]) -> usize {
    use core::arch::wasm32::{
        i8x16_shuffle, i16x8_add, i16x8_q15mulr_sat, i16x8_splat, i16x8_sub, u8x16_narrow_i16x8, u16x8_extend_low_u8x16, u64x2,
        u64x2_extract_lane, v128,
    };
    let eight = |row: &[u8], at: usize| -> v128 {
        let bytes: [u8; 8] = row.get(at..at + 8).and_then(|b| b.try_into().ok()).unwrap_or_default();
        u16x8_extend_low_u8x16(u64x2(u64::from_le_bytes(bytes), 0))
    };
    let pixels = luma.len().min(blue.len()).min(red.len()).min(out.len() / 3);
    let whole = pixels - pixels % 8;
    let centre = i16x8_splat(128);
    for at in (0..whole).step_by(8) {
        let l = eight(luma, at);
        let (b, r) = (i16x8_sub(eight(blue, at), centre), i16x8_sub(eight(red, at), centre));
        let red = i16x8_add(i16x8_add(l, r), i16x8_q15mulr_sat(r, i16x8_splat(13173)));
        let green = i16x8_sub(l, i16x8_add(i16x8_q15mulr_sat(b, i16x8_splat(11277)), i16x8_q15mulr_sat(r, i16x8_splat(23401))));
        let blue = i16x8_sub(i16x8_add(l, i16x8_add(b, b)), i16x8_q15mulr_sat(b, i16x8_splat(7471)));
        // [r0..r7, g0..g7] and [b0..b7, b0..b7] → r0 g0 b0 r1 g1 b1 … r7 g7 b7.
        let (red_green, blue) = (u8x16_narrow_i16x8(red, green), u8x16_narrow_i16x8(blue, blue));
        let first = i8x16_shuffle::<0, 8, 16, 1, 9, 17, 2, 10, 18, 3, 11, 19, 4, 12, 20, 5>(red_green, blue);
        let rest = i8x16_shuffle::<13, 21, 6, 14, 22, 7, 15, 23, 0, 0, 0, 0, 0, 0, 0, 0>(red_green, blue);
        let words = [u64x2_extract_lane::<0>(first), u64x2_extract_lane::<1>(first), u64x2_extract_lane::<0>(rest)];
        for (chunk, word) in out[3 * at..3 * at + 24].chunks_exact_mut(8).zip(words) {
            chunk.copy_from_slice(&word.to_le_bytes());
        }
    }
    whole
}

/// Without `simd128`, [`ycbcr_to_rgb`] converts every pixel one by one.
#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
fn ycbcr_to_rgb_simd(_: &[u8], _: &[u8], _: &[u8], _: &mut [u8]) -> usize {
    0
}

/// Row `y` of the full-resolution image, from a plane `stride` wide that
/// has half the resolution across and/or down (`halved`): each output
/// pixel weighs its nearest plane pixel 3 and the next nearest 1 each way
/// (libjpeg's "fancy" upsampling), so chroma edges are not blocky. `sums`
/// is scratch space.
fn upsample_row(plane: &[u8], stride: usize, (across, down): (bool, bool), y: usize, out: &mut [u8], sums: &mut Vec<u16>) {
    if !across && !down {
        out.copy_from_slice(&plane[y * stride..y * stride + out.len()]);
        return;
    }
    let rows = plane.len() / stride;
    let near = if down { y >> 1 } else { y };
    let far = if !down {
        near
    } else if y & 1 == 1 {
        (near + 1).min(rows - 1)
    } else {
        near.saturating_sub(1)
    };
    let (near, far) = (&plane[near * stride..(near + 1) * stride], &plane[far * stride..(far + 1) * stride]);
    // Column sums (×4 in all), in straight loops the compiler turns into SIMD.
    let sum = |(&near, &far): (&u8, &u8)| 3 * u16::from(near) + u16::from(far);
    if !across {
        for (pixel, pair) in out.iter_mut().zip(near.iter().zip(far)) {
            *pixel = ((sum(pair) + 2) >> 2) as u8;
        }
        return;
    }
    // Padded by repeating the edge sums: sums[c + 1] is column c's.
    sums.clear();
    sums.push(sum((&near[0], &far[0])));
    sums.extend(near.iter().zip(far).map(sum));
    sums.push(sum((&near[stride - 1], &far[stride - 1])));
    // Output pixels 2c and 2c + 1 weigh column c 3 and its left or right neighbour 1.
    let pixel = |centre: u16, other: u16| ((3 * centre + other + 8) >> 4) as u8;
    let c = out.len() / 2;
    let mut pairs = out.chunks_exact_mut(2);
    for (pair, s) in (&mut pairs).zip(sums.windows(3)) {
        pair[0] = pixel(s[1], s[0]);
        pair[1] = pixel(s[1], s[2]);
    }
    if let [last] = pairs.into_remainder() {
        *last = pixel(sums[c + 1], sums[c]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> Vec<u8> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/jpeg").join(name);
        std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    /// jpeg-decoder's decode of `bytes` at `1/denom`: size, grey or not, pixels.
    fn reference(bytes: &[u8], denom: u16) -> (u32, u32, bool, Vec<u8>) {
        let mut decoder = jpeg_decoder::Decoder::new(bytes);
        decoder.read_info().expect("header");
        let info = decoder.info().expect("info");
        let (w, h) = decoder.scale(info.width.div_ceil(denom), info.height.div_ceil(denom)).expect("scale");
        let pixels = decoder.decode().expect("decode");
        (u32::from(w), u32::from(h), info.pixel_format == jpeg_decoder::PixelFormat::L8, pixels)
    }

    /// Every sampling layout, restart intervals and a size that is no
    /// multiple of the MCU: the same size and, within rounding, the same
    /// pixels as jpeg-decoder's decode, full size or reduced.
    #[test]
    fn matches_jpeg_decoder_at_every_scale() {
        for name in ["420-restart-rows.jpg", "444-restart-blocks.jpg", "422.jpg", "grey.jpg"] {
            let bytes = fixture(name);
            for denom in [1u16, 2, 4, 8] {
                let (w, h, grey, expected) = reference(&bytes, denom);
                let ours = decode(&bytes, 8 / usize::from(denom), u64::MAX).expect("decodes").expect("baseline");
                assert_eq!((ours.width, ours.height, ours.grey), (w, h, grey), "{name} at 1/{denom}");
                let total: u64 = ours.pixels.iter().zip(&expected).map(|(a, b)| u64::from(a.abs_diff(*b))).sum();
                let mean = total as f64 / expected.len() as f64;
                // jpeg-decoder rounds its 1/8 scale's DC differently; the rest agree to a hundredth.
                let bound = if denom == 8 { 1.5 } else { 0.5 };
                assert!(mean < bound, "{name} at 1/{denom}: mean difference {mean:.3} levels");
            }
        }
    }

    /// The table-driven transform of the scales without butterflies gives,
    /// at 2×2 and 4×4, what the butterflies give (within a level of
    /// rounding), on blocks of random coefficients and quantisers: the one
    /// formula behind 3/8, 5/8, 6/8 and 7/8 is right.
    #[test]
    fn the_table_transform_agrees_with_the_butterflies() {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move |range: i32| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % range as u64) as i32 - range / 2
        };
        for n in [2usize, 4] {
            let basis = Basis::new(n);
            for _ in 0..200 {
                let raw: [u16; 64] = std::array::from_fn(|_| (next(30) + 16) as u16);
                let coefficients: [i32; 64] = std::array::from_fn(|k| if k < 20 { next(60) } else { 0 });
                let (mut a, mut b) = (coefficients, coefficients);
                let (mut by_butterflies, mut by_table) = ([0u8; 16], [0u8; 16]);
                write_reduced(&mut a, 20, &dequantiser(&raw, n), &basis, &mut by_butterflies, 4);
                // The table's quantiser is in natural order, as at 3/8.
                let natural = dequantiser(&raw, 3);
                match n {
                    2 => write_n::<2>(&mut b, &natural, &basis, &mut by_table, 4),
                    _ => write_n::<4>(&mut b, &natural, &basis, &mut by_table, 4),
                }
                for y in 0..n {
                    for x in 0..n {
                        let (p, q) = (by_butterflies[y * 4 + x], by_table[y * 4 + x]);
                        assert!(p.abs_diff(q) <= 1, "{n}×{n} at ({y}, {x}): {p} against {q}");
                    }
                }
            }
        }
    }

    /// The scales jpeg-decoder lacks (3/8, 5/8, 6/8, 7/8): libjpeg's sizes
    /// (each side rounded up) and, within what two ways of shrinking
    /// differ by, the full-size decode resized to the same size. A
    /// transform off by a transposition, a sign or a scale would be tens
    /// of levels off.
    #[test]
    fn the_other_eighths_match_the_full_decode_resized() {
        use image::imageops::{FilterType, resize};
        for name in ["420-restart-rows.jpg", "444-restart-blocks.jpg", "422.jpg", "grey.jpg"] {
            let bytes = fixture(name);
            let full = decode(&bytes, 8, u64::MAX).expect("decodes").expect("baseline");
            let channels = if full.grey { 1 } else { 3 };
            for eighths in [3usize, 5, 6, 7] {
                let ours = decode(&bytes, eighths, u64::MAX).expect("decodes").expect("baseline");
                let side = |full: u32| (full as usize * eighths).div_ceil(8) as u32;
                assert_eq!((ours.width, ours.height), (side(full.width), side(full.height)), "{name} at {eighths}/8");
                let expected: Vec<u8> = if full.grey {
                    let image = image::GrayImage::from_raw(full.width, full.height, full.pixels.clone()).expect("grey");
                    resize(&image, ours.width, ours.height, FilterType::Triangle).into_raw()
                } else {
                    let image = image::RgbImage::from_raw(full.width, full.height, full.pixels.clone()).expect("rgb");
                    resize(&image, ours.width, ours.height, FilterType::Triangle).into_raw()
                };
                assert_eq!(ours.pixels.len(), expected.len() / channels * channels);
                let total: u64 = ours.pixels.iter().zip(&expected).map(|(a, b)| u64::from(a.abs_diff(*b))).sum();
                let mean = total as f64 / expected.len() as f64;
                // These noisy fixtures differ by 6.9 levels at 4/8, where
                // the decode matches jpeg-decoder's; 9.4 at 3/8, 4.8 at 7/8.
                assert!(mean < 12.0, "{name} at {eighths}/8: mean difference {mean:.3} levels");
            }
        }
    }

    #[test]
    fn other_kinds_of_jpeg_are_left_to_the_general_decoder() {
        assert!(decode(&fixture("progressive.jpg"), 4, u64::MAX).expect("no error").is_none(), "progressive");
        assert!(decode(b"\x89PNG\r\n\x1a\n", 4, u64::MAX).expect("no error").is_none(), "not a JPEG");
        for eighths in [0, 9, 16] {
            assert!(decode(&fixture("422.jpg"), eighths, u64::MAX).expect("no error").is_none(), "no scale {eighths}/8");
        }
        // Baseline, but with the Adobe marker's RGB transform: not YCbCr.
        let baseline = fixture("444-restart-blocks.jpg");
        let mut adobe = baseline[..2].to_vec();
        adobe.extend_from_slice(&[0xFF, 0xEE, 0, 14]);
        adobe.extend_from_slice(b"Adobe\0\x64\0\0\0\0\0");
        adobe.extend_from_slice(&baseline[2..]);
        assert!(decode(&adobe, 4, u64::MAX).expect("no error").is_none(), "Adobe RGB");
        // Components named R, G and B, in the frame and the scan: RGB too.
        let mut named = baseline.clone();
        let marker = |m: u8| named.windows(2).position(|w| w == [0xFF, m]).expect("marker");
        let (frame, scan) = (marker(0xC0), marker(0xDA));
        for (i, id) in b"RGB".iter().enumerate() {
            named[frame + 10 + 3 * i] = *id;
            named[scan + 5 + 2 * i] = *id;
        }
        assert!(decode(&named, 4, u64::MAX).expect("no error").is_none(), "ids R, G, B");
    }

    #[test]
    fn truncated_data_and_tight_limits_are_errors() {
        let bytes = fixture("420-restart-rows.jpg");
        for cut in [40, bytes.len() / 3, bytes.len() / 2, bytes.len() - 600] {
            for eighths in [8, 2] {
                assert!(decode(&bytes[..cut], eighths, u64::MAX).is_err(), "cut at {cut} of {}, {eighths}/8", bytes.len());
            }
        }
        let error = decode(&bytes, 2, 1000).expect_err("over the limit");
        assert!(error.contains("more memory"), "{error}");
    }

    /// Damaged files (bytes changed at random, header and data alike) give
    /// an image or an error, never a panic.
    #[test]
    fn damaged_files_never_panic() {
        let mut state = 0x9e37_79b9_u32;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state as usize
        };
        for name in ["420-restart-rows.jpg", "444-restart-blocks.jpg", "grey.jpg"] {
            let original = fixture(name);
            for _ in 0..200 {
                let mut bytes = original.clone();
                for _ in 0..1 + next() % 8 {
                    let at = next() % bytes.len();
                    bytes[at] = next() as u8;
                }
                let _ = decode(&bytes, [1, 2, 4, 8][next() % 4], 64 << 20);
            }
        }
    }
}
