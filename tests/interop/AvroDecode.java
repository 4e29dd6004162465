import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.node.ObjectNode;
import java.io.File;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Base64;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import org.apache.avro.AvroTypeException;
import org.apache.avro.Schema;
import org.apache.avro.SchemaNormalization;
import org.apache.avro.SchemaParseException;
import org.apache.avro.generic.GenericData;
import org.apache.avro.generic.GenericRecord;
import org.apache.avro.message.BinaryMessageDecoder;
import org.apache.avro.message.BinaryMessageEncoder;
import org.apache.avro.message.RawMessageDecoder;
import org.apache.avro.message.SchemaStore;

/**
 * Reads rollstream events with the Avro reference implementation, knowing only the schema files.
 *
 * <p>Usage: {@code java -cp 'avro-jars/*' AvroDecode.java SCHEMA_DIR CASES_JSONL}. The schema
 * directory holds rollstream's {@code *.avsc} (which name each other's types), {@code
 * history/*.avsc} (older writer versions, each self-contained) and {@code history/legacy_fingerprints.json}
 * (fingerprints rollstream once wrote by mistake -> the schema file they stand for). Each case line
 * is {@code {"file": ..., "message": base64}}: a single-object encoded event. For each case one JSON line goes to stdout: the full
 * name of the decoded record, the parsing fingerprint Java computes for the case's schema file, and
 * the event encoded again by Java from what it decoded (equal bytes mean equal field values), or
 * the error.
 */
public class AvroDecode {

  public static void main(String[] args) throws Exception {
    Path dir = Paths.get(args[0]);
    Map<String, Schema> current = parseCurrent(dir);
    Map<String, Schema> byFile = new LinkedHashMap<>(current);
    SchemaStore.Cache store = new SchemaStore.Cache();
    current.values().forEach(store::addSchema);
    File[] history = dir.resolve("history").toFile().listFiles((d, n) -> n.endsWith(".avsc"));
    for (File file : history == null ? new File[0] : history) {
      Schema old = new Schema.Parser().parse(file); // history files are self-contained
      byFile.put("history/" + file.getName(), old);
      store.addSchema(old);
    }
    ObjectMapper json = new ObjectMapper();
    // Legacy fingerprints: the header names no schema's real fingerprint, so such an event's body
    // is read with a RawMessageDecoder for the schema the table names.
    Map<Long, Schema> legacy = new LinkedHashMap<>();
    Path legacyFile = dir.resolve("history").resolve("legacy_fingerprints.json");
    if (Files.exists(legacyFile)) {
      json.readTree(legacyFile.toFile()).fields().forEachRemaining(
          e -> legacy.put(Long.parseLong(e.getKey()), byFile.get(e.getValue().get("file").asText())));
    }
    for (String line : Files.readAllLines(Paths.get(args[1]))) {
      JsonNode item = json.readTree(line);
      String file = item.get("file").asText();
      ObjectNode out = json.createObjectNode().put("file", file);
      try {
        Schema writer = byFile.get(file);
        byte[] message = Base64.getDecoder().decode(item.get("message").asText());
        // The decoder finds the writer schema by the message's fingerprint in the store, exactly
        // as a consumer of a rollstream topic would.
        long fp = ByteBuffer.wrap(message, 2, 8).order(ByteOrder.LITTLE_ENDIAN).getLong();
        GenericRecord record = legacy.containsKey(fp)
            ? new RawMessageDecoder<GenericRecord>(GenericData.get(), legacy.get(fp), writer)
                .decode(Arrays.copyOfRange(message, 10, message.length))
            : new BinaryMessageDecoder<GenericRecord>(GenericData.get(), writer, store).decode(message);
        ByteBuffer again = new BinaryMessageEncoder<GenericRecord>(GenericData.get(), writer).encode(record);
        byte[] bytes = new byte[again.remaining()];
        again.get(bytes);
        out.put("full_name", record.getSchema().getFullName())
            .put("fingerprint", SchemaNormalization.parsingFingerprint64(writer))
            .put("reencoded", Base64.getEncoder().encodeToString(bytes));
      } catch (Exception exc) {
        out.put("error", exc.getClass().getSimpleName() + ": " + exc.getMessage());
      }
      System.out.println(out);
    }
  }

  /** The current schemas by file name; files that name a type of another file wait for it. */
  static Map<String, Schema> parseCurrent(Path dir) throws Exception {
    List<File> pending = new ArrayList<>();
    for (File file : dir.toFile().listFiles((d, n) -> n.endsWith(".avsc"))) {
      pending.add(file);
    }
    Map<String, Schema> parsed = new LinkedHashMap<>();
    while (!pending.isEmpty()) {
      List<File> waiting = new ArrayList<>();
      for (File file : pending) {
        try {
          parsed.put(file.getName(), parseWith(file, parsed));
        } catch (AvroTypeException | SchemaParseException unresolved) { // names a type not parsed yet
          waiting.add(file);
        }
      }
      if (waiting.size() == pending.size()) {
        throw new IllegalStateException("unresolvable schema files: " + waiting);
      }
      pending = waiting;
    }
    return parsed;
  }

  /** Parses one file knowing the named types of {@code known}, except those the file redefines. */
  static Schema parseWith(File file, Map<String, Schema> known) throws Exception {
    String text = Files.readString(file.toPath());
    String ownName = new ObjectMapper().readTree(text).get("name").asText();
    List<Schema> types = new ArrayList<>();
    for (Schema schema : known.values()) {
      collectNamed(schema, types);
    }
    types.removeIf(s -> s.getName().equals(ownName) || s.getFullName().equals(ownName));
    Map<String, Schema> unique = new LinkedHashMap<>();
    types.forEach(s -> unique.putIfAbsent(s.getFullName(), s));
    return new Schema.Parser().addTypes(unique.values()).parse(text);
  }

  static void collectNamed(Schema schema, List<Schema> out) {
    switch (schema.getType()) {
      case RECORD:
        if (out.contains(schema)) {
          return;
        }
        out.add(schema);
        schema.getFields().forEach(f -> collectNamed(f.schema(), out));
        break;
      case ENUM:
      case FIXED:
        out.add(schema);
        break;
      case ARRAY:
        collectNamed(schema.getElementType(), out);
        break;
      case MAP:
        collectNamed(schema.getValueType(), out);
        break;
      case UNION:
        schema.getTypes().forEach(s -> collectNamed(s, out));
        break;
      default:
        break;
    }
  }
}
